"""The random BERT of `strata bench embed` (`python -m strata.bench.random_model bert-110m DIR`): bert-base's shape with
a WordPiece vocabulary of the bench's words and sentence-transformers' mean pooling + Normalize beside it, and its
GGUF through llama.cpp's converter (`python -m strata.bench.random_encoder LLAMA_CPP_DIR DIR OUT.gguf`)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

# A random WordPiece vocabulary has no pre-tokenizer hash llama.cpp knows; BERT's WPM tokenizer needs none.
_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import convert_hf_to_gguf as convert
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert.main()
"""


def bert_embedder(output: Path, seed: int = 0) -> torch.nn.Module:
    """A bert-base-shaped BertModel (109.5M parameters, float32) written to `output` with its tokenizer and a
    sentence-transformers config (mean pooling, normalized)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from strata.bench.embed import _WORDS

    words = sorted(set(_WORDS))
    chars = sorted({c for w in words for c in w})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *chars, *("##" + c for c in chars)]
    vocab += [f"[unused{i}]" for i in range(BertConfig().vocab_size - len(vocab))]
    output.mkdir(parents=True, exist_ok=True)
    BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True,
                      model_max_length=512).save_pretrained(output)
    torch.manual_seed(seed)
    model = BertModel(BertConfig())
    model.save_pretrained(output)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (output / "modules.json").write_text(json.dumps(modules))
    for folder in ("1_Pooling", "2_Normalize"):
        (output / folder).mkdir(exist_ok=True)
    (output / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": model.config.hidden_size, "pooling_mode_mean_tokens": True,
         "pooling_mode_cls_token": False}))
    (output / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="convert the bench's random BERT to an f32 GGUF with llama.cpp's "
                                                 "converter (for `strata bench embed --compare-llama-embedding`)")
    parser.add_argument("llama_cpp", type=Path, help="a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    parser.add_argument("model", type=Path)
    parser.add_argument("outfile", type=Path)
    args = parser.parse_args(argv)
    subprocess.run([sys.executable, "-c", _CONVERT, str(args.llama_cpp), str(args.model), "--outfile",
                    str(args.outfile), "--outtype", "f32"], check=True)


if __name__ == "__main__":
    main()

"""Tiny random-weight BERT checkpoints written by transformers, with a sentence-transformers pipeline beside them."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from checkpoints import CORPUS

_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def _vocab() -> list[str]:
    words = sorted({w for text in CORPUS for w in re.findall(r"\w+|[^\w\s]", text.lower())})
    pieces = sorted({"##" + c for w in words for c in w} | {c for w in words for c in w})
    return _SPECIALS + sorted(set(words) | set(pieces))


def write_bert_checkpoint(folder: Path, pooling: str | None = "mean", normalize: bool = True, hidden: int = 64,
                          layers: int = 2, heads: int = 4, intermediate: int = 128, max_positions: int = 64,
                          seed: int = 0, **config_extra) -> Path:
    """A BertModel (float32) with its WordPiece tokenizer; with `pooling`, modules.json + 1_Pooling (+ 2_Normalize)
    as sentence-transformers writes them."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(_vocab()) + "\n")
    BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True, model_max_length=max_positions
                      ).save_pretrained(folder)
    config = BertConfig(vocab_size=len(_vocab()), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=intermediate,
                        max_position_embeddings=max_positions, **config_extra)
    torch.manual_seed(seed)
    model = BertModel(config)
    with torch.no_grad():  # larger than BERT's 0.02 init, so that layers change the states visibly
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    if pooling is None:
        return folder
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pool = {"word_embedding_dimension": hidden, **{key: mode == pooling for mode, key in _POOLING_KEYS.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_positions,
                                                                  "do_lower_case": False}))
    return folder

"""`strata bench embed` runs end to end on a tiny BERT and reports its figures beside sentence-transformers' and
llama.cpp's llama-embedding's."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from bert_checkpoints import write_bert_checkpoint

from strata.cli import main


def test_bench_embed_reports_strata_and_sentence_transformers(tmp_path, capsys):
    folder = write_bert_checkpoint(tmp_path / "bert")
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--model", str(folder), "--num-sentences", "12", "--rounds", "1",
                 "--min-words", "2", "--max-words", "40", "--compare-sentence-transformers", "--gemm-peak",
                 "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert figures["num_sentences"] == 12 and figures["num_tokens"] > 12 * 2
    for name in ("strata", "sentence-transformers"):
        assert figures[name]["sentences_per_s"] > 0
        assert f"{name}: " in printed and "sentences/s" in printed
        assert figures[name]["gflops_per_s"] > 0  # a BERT: its work is counted
    assert figures["gemm_peak"]["gflops_per_s"] > 0 and "float32 GEMM peak" in printed
    assert "strata / sentence-transformers: " in printed


def _llama_embedding() -> Path | None:
    default = (Path.home() / ".cache/strata-anchors/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
               / "llama-embedding")
    path = Path(os.environ.get("STRATA_LLAMA_EMBEDDING", default))
    return path if path.is_file() else None


@pytest.mark.skipif(_llama_embedding() is None, reason="no llama-embedding build (cmake --build build --target "
                                                       "llama-embedding in llama.cpp; or set STRATA_LLAMA_EMBEDDING)")
def test_bench_embed_times_llama_embedding_on_the_gguf_of_the_same_checkpoint(tmp_path, capsys):
    """llama.cpp's converter writes the BERT as GGUF; its embeddings agree with strata's (the printed cosine)."""
    from llama_cpp_gguf import convert

    folder = write_bert_checkpoint(tmp_path / "bert", pooling="cls", normalize=False, heads=2,
                                    max_positions=512)  # the bench words split into letters here
    gguf = convert(folder, tmp_path / "bert-f32.gguf")
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--model", str(folder), "--num-sentences", "8", "--rounds", "1",
                 "--min-words", "2", "--max-words", "12", "--compare-llama-embedding", str(_llama_embedding()),
                 "--llama-gguf", str(gguf), "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    cosine = float(re.search(r"llama-embedding vs strata on 8 sentences: lowest cosine ([\d.]+)", printed).group(1))
    assert cosine > 0.9999
    assert json.loads(out.read_text())["llama-embedding"]["sentences_per_s"] > 0
    assert "strata / llama-embedding: " in printed


def test_encoder_flops_count_linears_per_token_and_attention_per_sequence(tmp_path):
    from strata.bench.embed_flops import encoder_flops
    from strata.config.hf_config import read_config_json

    hf = read_config_json(write_bert_checkpoint(tmp_path / "bert") / "config.json")  # hidden 64, 2 layers, MLP 128
    per_token = 2 * 2 * (4 * 64 * 64 + 2 * 64 * 128)
    assert encoder_flops(hf, [3, 5]) == 8 * per_token + 2 * 2 * 2 * 64 * (3 * 3 + 5 * 5)

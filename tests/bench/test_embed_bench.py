"""`strata bench embed` runs end to end on a tiny BERT and reports both engines' figures."""
from __future__ import annotations

import json

from bert_checkpoints import write_bert_checkpoint

from strata.cli import main


def test_bench_embed_reports_strata_and_sentence_transformers(tmp_path, capsys):
    folder = write_bert_checkpoint(tmp_path / "bert")
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--model", str(folder), "--num-sentences", "12", "--rounds", "1",
                 "--min-words", "2", "--max-words", "40", "--compare-sentence-transformers",
                 "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert figures["num_sentences"] == 12 and figures["num_tokens"] > 12 * 2
    for name in ("strata", "sentence-transformers"):
        assert figures[name]["sentences_per_s"] > 0
        assert f"{name}: " in printed and "sentences/s" in printed

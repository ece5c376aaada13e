"""`strata bench speculative`: its workload is real stdlib source and docstrings (checked against `inspect`), and a
run reports every method at every concurrency, with the same greedy tokens as no speculation."""
from __future__ import annotations

import inspect
import json
import textwrap

from strata.bench.grounded import grounded_texts
from strata.bench.machine import cpu_model
from strata.cli import main


def test_the_grounded_workload_quotes_the_stdlib_source_it_names():
    texts = grounded_texts(40, seed=1)
    assert len(set(texts)) == 40
    renames = [t for t in texts if t.startswith("Repeat this Python function")]
    assert renames and any(t.startswith("Here is the documentation") for t in texts)
    assert inspect.getsource(textwrap.dedent) in "".join(grounded_texts(400, seed=0))
    old, new = renames[0].split("`")[1], renames[0].split("`")[3]
    assert new == "new_" + old.lstrip("_") and renames[0].count(old) >= 3


def test_a_run_reports_each_method_and_concurrency_with_the_same_tokens(llama_gqa, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["bench", "speculative", "--model", str(llama_gqa), "--num-prompts", "2", "--output-len", "12",
                 "--concurrency", "1", "2", "--methods", "none", "ngram", "--max-input-len", "400",
                 "--max-model-len", "512", "--output-json", str(out)]) == 0
    machine = [line for line in capsys.readouterr().out.splitlines() if line.startswith("CPU: ")]
    assert len(machine) == 2 and machine[0].startswith(f"CPU: {cpu_model()}, ")  # one per method
    rows = json.loads(out.read_text())
    assert [(r["method"], r["concurrency"]) for r in rows] == [("none", 1), ("none", 2), ("ngram", 1), ("ngram", 2)]
    assert all(r["same_tokens_as_none"] and r["same_outputs"] == r["num_outputs"] == 2
               for r in rows if r["method"] == "ngram")
    assert all(r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0 for r in rows)


def test_a_line_whose_tokens_differ_from_none_says_how_many_outputs_agree():
    from strata.bench.speculative import _line
    row = {"method": "ngram", "concurrency": 1, "output_tokens": 90, "elapsed_s": 1.0, "output_tokens_per_s": 90.0,
           "num_outputs": 8, "speedup": 1.5, "same_tokens_as_none": False, "same_outputs": 6}
    assert _line(row).rstrip().endswith("1.50x none, same tokens: False (6 of 8 outputs)")

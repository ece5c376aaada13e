"""The one-GPU check script, exercised on CPU: its quick mode end to end, and its fail-soft pieces one by one."""
from __future__ import annotations

import json

import torch

from strata.bench import gpu_check
from strata.bench.gpu_sections import SECTIONS
from strata.bench.hf_baseline import _run_batches, left_padded

GPU_TESTS = """
import pytest

@pytest.mark.gpu
def test_passes():
    pass

@pytest.mark.gpu
def test_fails():
    assert False

@pytest.mark.gpu
def test_skips():
    pytest.skip("no")

def test_not_gpu_is_deselected():
    pass
"""


def test_quick_cpu_run_fills_every_section(tmp_path):
    tests = tmp_path / "test_fake_gpu.py"
    tests.write_text(GPU_TESTS)
    out = tmp_path / "report.json"
    gpu_check.main(["--device", "cpu", "--quick", "--isolation", "inline", "--out", str(out),
                    "--workdir", str(tmp_path / "work"), "--gpu-tests", f"{tests},tests/no_such_folder"])
    report = json.loads(out.read_text())
    assert report["meta"]["finished"] and report["meta"]["quick"]
    assert list(report["sections"]) == list(SECTIONS)
    for name, entry in report["sections"].items():
        assert entry["status"] == ("failed" if name == "gpu_tests" else "ok"), (name, entry.get("error"))
        assert entry["elapsed_s"] >= 0 and entry["result"]["summary"]
    sections = {name: entry["result"] for name, entry in report["sections"].items()}
    tests_run = sections["gpu_tests"]
    assert (tests_run["passed"], tests_run["failed"], tests_run["skipped"]) == (1, 1, 1)
    # JUnit names a file outside the rootdir by its path from there, so only the end is fixed.
    assert len(tests_run["failed_tests"]) == 1 and tests_run["failed_tests"][0].endswith("test_fake_gpu::test_fails")
    assert tests_run["missing_paths"] == ["tests/no_such_folder"]
    assert sections["environment"]["copy_gb_per_s"] > 0 and sections["environment"]["bf16_matmul_tflops"] > 0
    for family in ("llama", "mamba2", "plamo2"):
        assert sections[f"{family}_strata"]["output_tokens_per_second"] > 0
    for family in ("llama", "mamba2"):
        assert sections[f"{family}_transformers"]["prompts_run"] == 4
        assert report["comparisons"][family]["ratio"] > 0
    decode = sections["llama_decode_batch1"]
    assert decode["ms_per_token"] > 0 and 0 < decode["fraction_of_floor"]
    assert decode["weight_bytes"] == sections["llama_strata"]["weight_bytes"]
    assert sections["kernel_benchmarks"]["summary"].startswith("not run")  # CUDA timings only


def test_sections_past_the_budget_are_skipped_with_a_note(tmp_path):
    out = tmp_path / "report.json"
    gpu_check.main(["--device", "cpu", "--quick", "--budget-s", "0", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {e["status"] for e in report["sections"].values()} == {"skipped"}
    assert all("budget" in e["note"] for e in report["sections"].values())


def test_a_section_in_a_child_process_reports_back(tmp_path):
    out = tmp_path / "report.json"
    gpu_check.main(["--device", "cpu", "--quick", "--sections", "environment", "--out", str(out)])
    entry = json.loads(out.read_text())["sections"]["environment"]
    assert entry["status"] == "ok" and entry["result"]["torch"] == torch.__version__
    assert entry["wall_s"] >= entry["elapsed_s"]


def test_a_failing_section_records_its_traceback_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(SECTIONS, "environment", (broken, 0, 10))
    out = tmp_path / "report.json"
    gpu_check.main(["--device", "cpu", "--quick", "--isolation", "inline", "--sections",
                    "environment,kernel_benchmarks", "--out", str(out)])
    sections = json.loads(out.read_text())["sections"]
    assert sections["environment"]["status"] == "error" and "kernel exploded" in sections["environment"]["error"]
    assert sections["kernel_benchmarks"]["status"] == "ok"


def test_transformers_baseline_halves_its_batch_on_out_of_memory(monkeypatch):
    sizes = []

    def generate(model, prompts, output_len, pad_id, device):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return len(prompts) * output_len

    monkeypatch.setattr("strata.bench.hf_baseline._generate", generate)
    prompts = [[5, 6, 7]] * 8
    result = _run_batches(None, prompts, 4, 1, "cpu", deadline=float("inf"))
    assert sizes == [8, 4, 2, 2, 2, 2]
    assert (result["prompts_run"], result["batch_size"], result["output_tokens"]) == (8, 2, 32)
    # Once split, sub-batches stop at the deadline; the first always runs.
    sizes.clear()
    result = _run_batches(None, prompts, 4, 1, "cpu", deadline=0.0)
    assert result["prompts_run"] == 2 and sizes == [8, 4, 2]


def test_left_padding_puts_prompts_at_the_right_edge():
    ids, mask = left_padded([[5, 6, 7], [8]], pad_id=1, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [1, 1, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]

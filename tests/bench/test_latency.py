"""`strata bench latency` times decode steps and reports tokens/s and weight bandwidth from the same figures, the
prefill's rate, and which CPU kernels ran (the measured GGUF kernel choice included)."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from strata.cli import main


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_bench_latency_reports_consistent_tokens_per_second_and_bandwidth(llama_tied, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", str(llama_tied), "--batch-size", "2", "--input-len", "5",
               "--output-len", "6", "--num-iters-warmup", "0", "--num-iters", "2", "--dtype", "float32",
               "--max-model-len", "64", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "output tokens/s" in printed and "Effective weight bandwidth" in printed and "Plain read loop" in printed
    assert "prompt tokens/s" in printed and "GFLOP/s" in printed
    assert result["read_loop_gb_per_s"] > 0 and result["torch_matmul_gflops"] > 0
    assert result["prefill_tokens_per_second"] == pytest.approx(2 * 5 / result["time_to_first_token"])
    assert result["time_per_output_token"] > 0
    assert result["output_tokens_per_second"] == pytest.approx(2 / result["time_per_output_token"])
    # A float32 checkpoint with tied embeddings holds exactly the model's parameters.
    with safe_open(str(llama_tied / "model.safetensors"), "pt") as f:
        assert result["weight_bytes"] == sum(_numel(f.get_slice(k).get_shape()) * 4 for k in f.keys())
    assert result["weight_bandwidth_gb_per_s"] == pytest.approx(result["weight_bytes"] / result["time_per_output_token"]
                                                                / 1e9)


def test_bench_latency_says_which_cpu_paths_ran(llama_tied, capsys):
    """Every decode step of a float32 Llama at batch 1 is one C call; the line names the kernels' build."""
    from strata.kernels.cpu import matmul as cpu_matmul

    rc = main(["bench", "latency", "--model", str(llama_tied), "--batch-size", "1", "--input-len", "5",
               "--output-len", "6", "--num-iters-warmup", "0", "--num-iters", "1", "--dtype", "float32",
               "--max-model-len", "64"])
    assert rc == 0
    printed = capsys.readouterr().out.splitlines()
    line = next(x for x in printed if x.startswith("CPU kernels:"))
    assert any(x.startswith("CPU: ") and x.endswith(" torch threads") for x in printed)  # the machine, named
    if cpu_matmul.available():
        assert "5 decode steps in one C call each" in line
        assert line.endswith(f"built for {cpu_matmul.instruction_set()}") and cpu_matmul.instruction_set() in (
            "AVX-512 with VNNI", "AVX-512", "AVX2", "portable C")


def test_bench_latency_names_the_measured_gguf_kernel_choice(gguf_tied_q4_1, capsys):
    from strata.kernels.cpu import abi
    from strata.kernels.cpu import matmul as cpu_matmul

    if not cpu_matmul.available() or cpu_matmul.instruction_set() == "portable C":
        pytest.skip("no fixed-point kernels in this build")
    rc = main(["bench", "latency", "--model", str(gguf_tied_q4_1), "--batch-size", "1", "--input-len", "5",
               "--output-len", "4", "--num-iters-warmup", "0", "--num-iters", "1", "--max-model-len", "64"])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU kernels:"))
    assert "GGUF fixed-point kernels (then float): Q4_1 up to" in line
    gemm = "AMX above" if cpu_matmul.gemm_library().gemm_engine(abi.KIND_Q4_1) == abi.GEMM_AMX else "FMA"
    assert f"large-batch GEMM: Q4_1 {gemm}" in line  # the engine each kind's layers take, as measured


def test_bench_latency_prints_best_of_n_and_mean_labelled(llama_tied, tmp_path, capsys):
    """Each timed figure twice, best of N and mean of the same N runs, the printed values those of the JSON, the
    means computed here from the JSON's own run times."""
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", str(llama_tied), "--batch-size", "1", "--input-len", "5",
               "--output-len", "6", "--num-iters-warmup", "0", "--num-iters", "3", "--dtype", "float32",
               "--max-model-len", "64", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    printed = {line.split(",")[0].split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert r["best_of"] == 3 and len(r["latencies"]) == 3 and len(r["prefill_latencies"]) == 3
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3) and r["best_latency"] == min(r["latencies"])
    assert r["time_to_first_token"] == min(r["prefill_latencies"])
    first = r["first_token_latencies"]  # the same batch with one output token: what a full run adds is decode
    assert r["time_per_output_token"] == pytest.approx((min(r["latencies"]) - min(first)) / 5)
    assert r["time_per_output_token_mean"] == pytest.approx((sum(r["latencies"]) - sum(first)) / 3 / 5)
    assert r["time_to_first_token_mean"] == pytest.approx(sum(r["prefill_latencies"]) / 3)
    assert r["output_tokens_per_second_mean"] == pytest.approx(1 / r["time_per_output_token_mean"])
    assert printed["Avg latency"].startswith(f"Avg latency: {r['avg_latency']:.4f} seconds (mean of 3 runs; "
                                             f"best of 3: {r['best_latency']:.4f} s;")
    assert printed["Time per output token"].startswith(
        f"Time per output token, best of 3: {r['time_per_output_token'] * 1e3:.2f} ms, "
        f"{r['output_tokens_per_second']:.2f} output tokens/s; mean: {r['time_per_output_token_mean'] * 1e3:.2f} ms")
    assert f"best of 3: {r['weight_bandwidth_gb_per_s']:.2f} GB/s; mean: " in printed["Effective weight bandwidth"]
    assert printed["Prefill"].startswith(f"Prefill, best of 3: {r['time_to_first_token'] * 1e3:.1f} ms")
    assert f"mean: {r['time_to_first_token_mean'] * 1e3:.1f} ms" in printed["Prefill"]

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
               "--output-len", "6", "--num-iters-warmup", "0", "--num-iters", "1", "--dtype", "float32",
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
    from strata.layers.quantization import cpu_matmul

    rc = main(["bench", "latency", "--model", str(llama_tied), "--batch-size", "1", "--input-len", "5",
               "--output-len", "6", "--num-iters-warmup", "0", "--num-iters", "1", "--dtype", "float32",
               "--max-model-len", "64"])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU kernels:"))
    if cpu_matmul.available():
        assert "5 decode steps in one C call each" in line
        assert line.endswith(f"built for {cpu_matmul.build()}") and cpu_matmul.build() in (
            "AVX-512 with VNNI", "AVX-512", "AVX2", "portable C")


def test_bench_latency_names_the_measured_gguf_kernel_choice(gguf_tied_q4_1, capsys):
    from strata.layers.quantization import cpu_matmul

    if not cpu_matmul.available() or cpu_matmul.build() == "portable C":
        pytest.skip("no fixed-point kernels in this build")
    rc = main(["bench", "latency", "--model", str(gguf_tied_q4_1), "--batch-size", "1", "--input-len", "5",
               "--output-len", "4", "--num-iters-warmup", "0", "--num-iters", "1", "--max-model-len", "64"])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU kernels:"))
    assert "GGUF fixed-point kernels (then float): Q4_1 up to" in line
    gemm = "AMX above" if cpu_matmul._gemm_library().gemm_engine(cpu_matmul.KIND_Q4_1) == 1 else "FMA"
    assert f"large-batch GEMM: Q4_1 {gemm}" in line  # the engine each kind's layers take, as measured

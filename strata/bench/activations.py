"""What the benchmarks print about the activations the GGUF products took (quantized_activations)."""
from __future__ import annotations

from typing import Any

from strata.bench.machine import machine_line


def gguf_activations(llm: Any) -> str:
    """One phrase: which activations the run's GGUF products took, and on which kernels."""
    from strata.config.quant_config import GGUFQuantConfig
    from strata.kernels.cpu import matmul as cpu_matmul

    quant = llm.engine.config.model.quant_config
    if not isinstance(quant, GGUFQuantConfig):
        return "activations float (no GGUF weights)"
    if quant.activations == "int8":
        return (f"GGUF products with int8 activations (x rounded to Q8_0 / Q8_K blocks as llama.cpp rounds it, "
                f"decode and prefill, {cpu_matmul.int8_activations_set()} kernels{_experts(quant)})")
    return "GGUF products with float activations"


def _experts(quant: Any) -> str:
    """The routed experts' share of the int8 products, when the file has experts."""
    from strata.gguf.types import MXFP4

    if MXFP4 in quant.tensor_types.values():
        return "; MXFP4 experts times Q8_0 rows, each token's row rounded once a step for all its experts"
    if any(".experts." in name for name in quant.tensor_types):
        return "; routed experts too, each token's row rounded once a step for all its experts"
    return ""


def activations_line(llm: Any) -> str:
    """The `CPU:` line (the machine) and the `CPU kernels:` line of `bench throughput` and `bench speculative`."""
    return f"{machine_line(llm.engine.config.device)}\nCPU kernels: {gguf_activations(llm)}\n"

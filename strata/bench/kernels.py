"""`strata bench kernels`: the CPU kernel choices this build has cached for this machine (GGUF fixed-point
crossovers, large-batch GEMM engines, small-batch crossovers per layer shape); `--recalibrate` forgets them and
measures the ones that need no model now (with --model, also that model's layers, by loading it)."""
from __future__ import annotations

import argparse
import json

# The kernels' modules are imported by the functions that use them: the command line parses without loading them.


def add_kernels_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recalibrate", action="store_true",
                        help="forget this build's cached kernel choices and measure them again (the crossovers of a "
                             "model's layer shapes are measured when it next loads, or now with --model); "
                             "STRATA_RECALIBRATE=1 does the same for one run of any command")
    parser.add_argument("--model", default=None,
                        help="also load this model (folder, .gguf file or Hub ID), measuring the crossovers of its "
                             "layer shapes not cached yet (all of them with --recalibrate)")


def recalibrate() -> None:
    """Forgets the cached choices, then measures every GGUF type's fixed-point crossover and every kind's GEMM
    engine (the crossovers of layer shapes need a model's weights)."""
    from strata.kernels.cpu import abi, crossovers
    from strata.layers.quantization import gguf_quants

    dense = (abi.KIND_BF16, abi.KIND_INT4, abi.KIND_INT8, abi.KIND_FP8)
    crossovers.forget()
    for qtype in sorted(gguf_quants.TYPES):
        crossovers.fixed_point_rows(qtype)
    for kind in (*dense, *(gguf_quants.kernel_kind(q) for q in sorted(gguf_quants.TYPES))):
        crossovers.gemm_engine(kind)


def load_model(model: str) -> None:
    """Loads `model` once: each of its layer shapes' crossovers is chosen (measured unless cached) before its first
    step."""
    from strata.llm import LLM

    with LLM(model):
        pass


def cached_choices() -> dict[str, int]:
    """This build's cached choices, as the file holds them (empty when none are cached)."""
    from strata.kernels.cpu import crossovers

    try:
        return json.loads(crossovers.cache_file().read_text())
    except (OSError, ValueError):
        return {}


def run_kernels(args: argparse.Namespace) -> int:
    from strata.kernels.cpu import crossovers
    from strata.kernels.cpu import matmul as cpu_matmul

    if not cpu_matmul.available():
        print("this build has no CPU kernels (no C compiler): there is nothing to choose or measure")
        return 1
    if args.recalibrate:
        recalibrate()
    if args.model is not None:
        load_model(args.model)
    choices = cached_choices()
    print(f"kernel choices cached for this build and CPU: {crossovers.cache_file()}")
    if not choices:
        print("  none yet (they are measured on a model's first load)")
    engines = crossovers.GEMM_ENGINES
    for key, value in sorted(choices.items()):
        if key.startswith("gemm "):
            meaning = f"{engines[value] if value in (0, 1) else value} GEMM for large batches"
        elif key.startswith("small-batch "):
            meaning = f"small-batch kernel up to {value} rows, then the GEMM"
        else:
            meaning = f"fixed-point kernels up to {value} rows, then float"
        print(f"  {key}: {meaning}")
    if args.recalibrate and crossovers.machine_was_busy():
        print("the machine was busy (timings did not repeat): choices not listed keep their defaults; run again when "
              "it is idle")
    return 0

"""LoRA in the offline benches (`--lora-path` or a random adapter of `--lora-rank`, spread over `--num-loras`
adapter ids): the requests' LoRARequests, and which decode path the adapter steps took."""
from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from strata.lora.request import LoRARequest

# The projections a random bench adapter targets (PEFT's names, as the base checkpoint spells them).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-path", default=None,
                        help="run every request with this PEFT LoRA adapter folder (needs --enable-lora)")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="without --lora-path: a random adapter of this rank on every q/k/v/o/gate/up/down "
                             "projection of a safetensors checkpoint (needs --enable-lora)")
    parser.add_argument("--num-loras", type=int, default=1,
                        help="requests spread round-robin over this many adapter ids (the same weights; each "
                             "takes its own slot and prefix-cache blocks)")


def random_adapter(model: str, folder: Path, rank: int, alpha: float = 16.0, seed: int = 0) -> Path:
    """A PEFT adapter folder of random A and B for every targeted linear of the checkpoint folder `model`, shaped
    from its safetensors headers (no weights are read)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
    if not files:
        raise SystemExit(f"--lora-rank writes an adapter for a safetensors checkpoint folder; {model} is not one "
                         "(give --lora-path)")
    generator = torch.Generator().manual_seed(seed)
    tensors, modules = {}, set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                module = name.removesuffix(".weight")
                if not name.endswith(".weight") or module.rpartition(".")[2] not in TARGETS:
                    continue
                out, inp = f.get_slice(name).get_shape()
                prefix = f"base_model.model.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) / inp ** 0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.01
                modules.add(module.rpartition(".")[2])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(modules),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def bench_lora_requests(args: argparse.Namespace, num_prompts: int) -> list[LoRARequest | None] | None:
    """Each prompt's adapter (round-robin over --num-loras ids), or None without --lora-path / --lora-rank."""
    path, rank = getattr(args, "lora_path", None), getattr(args, "lora_rank", None)
    if path is None and rank is None:
        return None
    if not args.enable_lora:
        raise SystemExit("--lora-path / --lora-rank need --enable-lora (and --max-loras >= --num-loras to run "
                         "them all at once)")
    if path is None:
        folder = Path(tempfile.mkdtemp(prefix="strata-bench-lora-"))
        atexit.register(shutil.rmtree, folder, True)
        path = str(random_adapter(args.model, folder, rank))
    loras = [LoRARequest(f"bench-{i}", i, path) for i in range(1, args.num_loras + 1)]
    return [loras[i % len(loras)] for i in range(num_prompts)]


def decode_path_line(llm: Any, loras: list[LoRARequest | None] | None) -> str:
    """Which path the decode steps took: the fused CPU paths add adapter rows' deltas in C (each projection's
    shrink and expand after its base product); steps they decline run in torch."""
    if not loras:
        return ""
    runner = getattr(llm.engine.executor, "runner", None)
    backend = getattr(runner, "cpu_decode", None)
    steps = llm.engine.stats["steps"]
    ids = {lora.lora_int_id for lora in loras if lora is not None}
    fused = "no fused CPU decode path here" if backend is None else \
        f"{sum(backend.served.values())} of {steps} steps on a fused CPU decode path, {backend.adapter_steps} of " \
        "them with adapter rows (shrink and expand in C)"
    return (f"LoRA: {len(ids)} adapter id(s) from {loras[0].lora_path}; {fused}; other steps with adapter rows run "
            "the modules' path (each projection's deltas beside it: in C up to 32 rows on CPU, else matmuls)\n")

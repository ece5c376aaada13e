"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) read and checked: what strata
serves (plain LoRA, bias "none", optional rsLoRA scaling) is taken, everything else refused with the reason."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from strata.errors import RequestError
from strata.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_PARAM = "lora_request"
# What LoRA applies to, for refusals of anything else.
SERVED_TARGETS = ("adapters may target the attention (q_proj, k_proj, v_proj, o_proj) and dense MLP (gate_proj, "
                  "up_proj, down_proj) projections of the decoder layers")


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights by the base checkpoint's module names: A [rank, in] and B [out, rank] of each targeted
    linear, and the scale its product is multiplied by (lora_alpha / rank, or / sqrt(rank) with rsLoRA)."""

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _refuse(request: LoRARequest, reason: str) -> RequestError:
    return RequestError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) cannot be served: {reason}",
                        param=_PARAM)


def read_config(request: LoRARequest, max_lora_rank: int) -> dict[str, Any]:
    """adapter_config.json, refused unless it is plain LoRA of a rank up to `max_lora_rank`."""
    folder = Path(request.lora_path)
    if not (folder / CONFIG_FILE).is_file():
        raise _refuse(request, f"{folder} has no {CONFIG_FILE} (expected a PEFT adapter folder)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise _refuse(request, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    # target_parameters first: PEFT writes a rank_pattern for them too, and this is the reason that matters.
    checks = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} is not LORA"),
        (bool(config.get("target_parameters")), f"target_parameters {config.get('target_parameters')} (LoRA on "
                                                f"MoE expert weights) is not supported: {SERVED_TARGETS}"),
        (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')} (fully trained "
                                              "copies of base modules) is not supported"),
        (bool(config.get("use_dora")), "DoRA (use_dora) is not supported"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} is not supported (only 'none')"),
        (bool(config.get("lora_bias")), "lora_bias is not supported"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D-style weights) is not supported"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")),
         "per-module rank_pattern / alpha_pattern is not supported"),
    ]
    for refused, reason in checks:
        if refused:
            raise _refuse(request, reason)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(request, f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise _refuse(request, f"its rank {rank} is above max_lora_rank={max_lora_rank} (start the engine with "
                               f"max_lora_rank >= {rank})")
    return config


def lora_scale(config: dict[str, Any]) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """The adapter's config checked and its A / B pairs read, by base module name."""
    config = read_config(request, max_lora_rank)
    path = Path(request.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        raise _refuse(request, f"{path.parent} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            module, kind = _split_key(request, key)
            pairs.setdefault(module, {})[kind] = f.get_tensor(key)
    rank, weights = config["r"], {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise _refuse(request, f"module {module} has {sorted(pair)} but needs both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(request, f"module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                                   f"[{rank}, in] and [out, {rank}]")
        weights[module] = (a, b)
    if not weights:
        raise _refuse(request, f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(request, rank, lora_scale(config), weights)


def _split_key(request: LoRARequest, key: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' (or '.lora_A.<adapter name>.weight') -> (module, 'lora_A')."""
    name = key.removeprefix(_PEFT_PREFIX)
    for kind in ("lora_A", "lora_B"):
        head, sep, tail = name.partition(f".{kind}.")
        if sep and tail.endswith("weight"):
            return head, kind
    if "lora_embedding" in name or "lora_magnitude" in name:
        raise _refuse(request, f"tensor {key} (LoRA on embeddings, or DoRA) is not supported")
    raise _refuse(request, f"tensor {key} is not a LoRA A or B weight (bias 'none' adapters only)")

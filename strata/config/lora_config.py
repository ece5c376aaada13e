"""LoRAConfig: how many LoRA adapters an engine serves at once (vLLM's enable_lora, max_loras, max_lora_rank,
max_cpu_loras), checked once at start-up."""
from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras`: adapters one step may use (each has a slot of stacked A / B weights in every targeted layer);
    `max_lora_rank`: the largest rank a slot holds; `max_cpu_loras`: adapters kept loaded in host memory (the
    slots' adapters and the most recently used others), at least max_loras."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


def lora_config(enable_lora: bool, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None
                ) -> LoRAConfig | None:
    """The checked LoRA configuration, or None when LoRA is off (then the model carries no LoRA weights at all).
    Every TP x PP layout serves adapters: each rank loads its part of them (from the same folder path)."""
    if not enable_lora:
        return None
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < max_loras:
        raise ConfigError(f"max_cpu_loras ({cpu!r}) must be an integer >= max_loras ({max_loras})",
                          param="max_cpu_loras")
    return LoRAConfig(max_loras, max_lora_rank, cpu)

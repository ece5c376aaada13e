"""Rank layout, process groups, TP collectives and the PP layer partition."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """Where this rank sits in the TP x PP grid, and the groups it talks through."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch ProcessGroup when tp_size > 1
    world_group: Any = None

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def log_prefix(self) -> str:
        return f"[tp{self.tp_rank} pp{self.pp_rank}]"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's `x` along `dim` (ordered by tp_rank)."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the member of stage `pp_rank` that shares this rank's tp_rank."""
        return pp_rank * self.tp_size + self.tp_rank


def rank_layout(tp_size: int, rank: int) -> tuple[int, int]:
    """(tp_rank, pp_rank) of a global rank: TP varies fastest."""
    return rank % tp_size, rank // tp_size


def pp_partition(num_layers: int, pp_size: int, custom: tuple[int, ...] | None = None) -> list[int]:
    """Layers per stage: vLLM's rule gives the remainder to the stages before the last, latest first."""
    if custom is not None:
        return list(custom)
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i if pp_size > 1 else 0] += 1
    return sizes


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int,
                   custom: tuple[int, ...] | None = None) -> tuple[int, int]:
    sizes = pp_partition(num_layers, pp_size, custom)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]

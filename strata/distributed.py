"""Where a rank sits in the TP x PP grid and what layers and models need of it: TP collectives (and the records
layers give of them), vocabulary padding, the PP layer partition and the hand-off of intermediate tensors between
stages. Process groups are made by the executor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ParallelContext:
    """Where this rank sits in the TP x PP grid, and the groups it talks through."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch ProcessGroup when tp_size > 1
    world_group: Any = None
    tp_shm: Any = None  # SharedMemoryGroup when the TP group shares one machine's memory (CPU)
    send_channel: Any = None  # SharedMemoryChannel to the next stage, when it is on this machine (CPU)
    recv_channel: Any = None  # ... from the previous stage

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
        if self.tp_size > 1 and not (self.tp_shm is not None and self.tp_shm.all_reduce(x)):
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's `x` along `dim` (ordered by tp_rank)."""
        if self.tp_size == 1:
            return x
        gathered = self.tp_shm.all_gather(x) if self.tp_shm is not None else None
        if gathered is not None:
            return torch.cat(gathered.unbind(0), dim=dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the member of stage `pp_rank` that shares this rank's tp_rank."""
        return pp_rank * self.tp_size + self.tp_rank

    def send_intermediate(self, tensors: IntermediateTensors) -> PendingSend:
        """Start sending this stage's output to the same TP rank of the next stage; wait() before reuse."""
        buffer = torch.stack([tensors.hidden_states, tensors.residual]).contiguous()
        if self.send_channel is not None and buffer.device.type == "cpu":
            self.send_channel.send(buffer)
            return PendingSend(None, buffer)
        work = dist.isend(buffer, self.stage_rank(self.pp_rank + 1), group=self.world_group)
        return PendingSend(work, buffer)

    def recv_intermediate(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                          device: torch.device) -> IntermediateTensors:
        """The previous stage's (hidden_states, residual) for a step of `num_tokens` tokens."""
        buffer = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        if self.recv_channel is not None and device.type == "cpu":
            self.recv_channel.recv(buffer)
        else:
            dist.recv(buffer, self.stage_rank(self.pp_rank - 1), group=self.world_group)
        hidden_states, residual = buffer.unbind(0)
        return IntermediateTensors(hidden_states, residual)


@dataclass(frozen=True)
class IntermediateTensors:
    """What a non-last pipeline stage hands to the next one; both are [num_tokens, hidden_size]."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


@dataclass
class PendingSend:
    """An isend in progress (None: already copied out); the buffer must live until it completes."""

    work: Any
    buffer: torch.Tensor

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


VOCAB_PADDING = 64


def pad_vocab(vocab_size: int, multiple: int = VOCAB_PADDING) -> int:
    """The vocabulary rounded up so that TP ranks get equal slices (config validation checks it divides)."""
    return -(-vocab_size // multiple) * multiple


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


@dataclass(frozen=True)
class StepSize:
    """The size of one forward step, as far as communication depends on it."""

    num_tokens: int  # tokens run through the model
    num_sampled: int  # rows whose logits are computed (0: the step samples nothing and skips the LM head)


@dataclass(frozen=True)
class Collective:
    """One TP collective a module issues in a step: `numel` elements of `dtype` go in from this rank (an
    all-gather returns tp_size times as many)."""

    kind: Literal["all_reduce", "all_gather"]
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def tp_collective(pc: ParallelContext, kind: Literal["all_reduce", "all_gather"], numel: int,
                  dtype: torch.dtype) -> list[Collective]:
    """The record of one collective through `pc`; none without TP, where `pc`'s collectives return at once."""
    return [Collective(kind, numel, dtype)] if pc.tp_size > 1 else []


def module_collectives(module: nn.Module, step: StepSize) -> list[Collective]:
    """Every TP collective `module` issues in `step`, in module order. A module with a `collectives(step)`
    method answers for itself and everything below it; the walk descends through the others."""
    report = getattr(module, "collectives", None)
    if report is not None:
        return report(step)
    return [c for child in module.children() for c in module_collectives(child, step)]

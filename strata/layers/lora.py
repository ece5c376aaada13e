"""LoRA in a linear layer, Punica / S-LoRA style: a fixed number of adapter slots hold stacked A and B weights, each
token row names its slot (-1: the base model alone), and the rows of each slot add scale * (x A^T) B^T (shrink,
then expand) to the base product.

A layer fusing several projections (q/k/v, gate/up) gives each projection a column block of its slot's A rows and B
columns: block j of an adapter of rank r is A[j r:(j + 1) r] and B[:, j r:(j + 1) r], B's rows only those of
projection j's outputs, so one shrink and one expand serve all of them. Layers keep this rank's part: B's rows follow a
column-parallel layer's outputs, A's columns a row-parallel layer's inputs (whose partial products the layer's
all-reduce sums like the base product's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """The step's rows of each slot in use: (slot, rows), rows a slice when they are contiguous, else an index
    tensor. Empty when no row of the step uses an adapter."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)

    @classmethod
    def from_spans(cls, spans: list[tuple[int, int, int]], device: torch.device) -> LoRABatch:
        """The groups of (slot, first row, end row) spans of the step (slot -1: no adapter), in the order slots
        first appear; a slot's rows are a slice when its spans touch, else an index tensor."""
        spans_of: dict[int, list[tuple[int, int]]] = {}
        for slot, start, end in spans:
            if slot >= 0 and end > start:
                spans_of.setdefault(slot, []).append((start, end))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, parts in spans_of.items():
            if all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1)):
                groups.append((slot, slice(parts[0][0], parts[-1][1])))
            else:
                rows = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in parts])
                groups.append((slot, rows.to(device)))
        return cls(groups)


@dataclass
class LoRAContext:
    """What every LoRA layer of a model reads: the current step's batch, set by the runner before each forward."""

    batch: LoRABatch = field(default_factory=LoRABatch)


class LinearLoRA:
    """The adapter slots of one linear layer: A [slots, blocks * max_rank, in], B [slots, out, blocks * max_rank],
    each slot's width (its columns in use: blocks x its rank; 0 when its adapter leaves this layer alone) and
    scale."""

    def __init__(self, num_slots: int, max_rank: int, num_blocks: int, in_features: int, out_features: int,
                 context: LoRAContext, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        width = num_blocks * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)
        self.num_blocks, self.max_rank, self.context = num_blocks, max_rank, context
        self.widths = [0] * num_slots
        self.scales = [0.0] * num_slots

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.widths[slot], self.scales[slot] = 0, 0.0

    def set_block(self, slot: int, block: int, rank: int, a: torch.Tensor, b_rows: list[tuple[int, torch.Tensor]],
                  scale: float) -> None:
        """Write one projection of an adapter into `slot`: A [rank, in] (this rank's inputs) into column block
        `block`, and each (output offset, rows [n, rank]) of B; the slot's scale is the adapter's."""
        cols = slice(block * rank, (block + 1) * rank)
        self.a[slot, cols].copy_(a)
        for offset, rows in b_rows:
            self.b[slot, offset:offset + rows.shape[0], cols].copy_(rows)
        self.widths[slot] = max(self.widths[slot], (block + 1) * rank)
        self.scales[slot] = scale

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x) plus each row's adapter delta, added in place."""
        groups = self.context.batch.groups
        if not groups:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, rows in groups:
            width = self.widths[slot]
            if width == 0:
                continue
            shrunk = x2[rows] @ self.a[slot, :width].T  # [n, width]
            delta = (shrunk @ self.b[slot, :, :width].T) * self.scales[slot]
            if isinstance(rows, slice):
                y2[rows] += delta
            else:
                y2.index_add_(0, rows, delta)
        return y

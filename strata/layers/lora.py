"""LoRA in a linear layer, Punica / S-LoRA style: a fixed number of adapter slots hold stacked A and B weights, each
token row names its slot (-1: the base model alone), and the rows of each slot add scale * (x A^T) B^T (shrink,
then expand) to the base product.

A layer fusing several projections (q/k/v, gate/up) gives each projection a column block of its slot's A rows and B
columns: block j of an adapter of rank r is A[j r:(j + 1) r] and B[:, j r:(j + 1) r], B's rows only those of
projection j's outputs, so one shrink and one expand serve all of them. Layers keep this rank's part: B's rows follow a
column-parallel layer's outputs, A's columns a row-parallel layer's inputs (whose partial products the layer's
all-reduce sums like the base product's).

On CPU a decode batch's float32 deltas run in C (strata/kernels/cpu/csrc/lora.c: each adapter's A and B read once for
all its rows, each block expanding into its own outputs), which keeps B transposed ([width, out]) so that the
expand streams contiguous outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.kernels.cpu import cpu_kernels_apply
from strata.kernels.cpu import lora as cpu_lora
from strata.kernels.cpu.abi import Lora

# Rows up to which a CPU step's float32 deltas take the C kernel (a decode batch: each adapter's A and B read once for
# all its rows, no per-slot gathers); more rows (prefill) take the slots' matmuls.
KERNEL_ROWS = 32


@dataclass
class LoRABatch:
    """The step's rows of each slot in use: (slot, rows), rows a slice when they are contiguous, else an index
    tensor. Empty when no row of the step uses an adapter; `row_slots` (CPU int64, -1: none) then None, else each
    row's slot, as the C kernel reads them."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    row_slots: torch.Tensor | None = None

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
        if not groups:
            return cls()
        row_slots = [-1] * max(end for _, _, end in spans)
        for slot, start, end in spans:
            row_slots[start:end] = [slot] * (end - start)
        return cls(groups, torch.tensor(row_slots, dtype=torch.int64))


@dataclass
class LoRAContext:
    """What every LoRA layer of a model reads: the current step's batch, set by the runner before each forward."""

    batch: LoRABatch = field(default_factory=LoRABatch)


class LinearLoRA:
    """The adapter slots of one linear layer: A [slots, blocks * max_rank, in], B^T [slots, blocks * max_rank, out],
    each slot's width (its columns in use: blocks x its rank; 0 when its adapter leaves this layer alone), rank and
    scale, and the outputs each block's B columns reach (the same for every adapter: the layer's projections)."""

    def __init__(self, num_slots: int, max_rank: int, num_blocks: int, in_features: int, out_features: int,
                 context: LoRAContext, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        width = num_blocks * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(num_slots, width, out_features, dtype=dtype, device=device)
        self.num_blocks, self.max_rank, self.context = num_blocks, max_rank, context
        self.widths = [0] * num_slots
        self.scales = [0.0] * num_slots
        # The same per slot and per block, in host memory for the C kernel (updated in place: it holds addresses).
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int64)
        self.slot_widths = torch.zeros(num_slots, dtype=torch.int64)
        self.slot_scales = torch.zeros(num_slots, dtype=torch.float32)
        self.block_rows = torch.zeros(num_blocks, 2, dtype=torch.int64)  # (first, end) output of each block's B
        self._view: Lora | None | bool = False  # False: not made yet

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.widths[slot], self.scales[slot] = 0, 0.0
        self.slot_ranks[slot] = self.slot_widths[slot] = 0
        self.slot_scales[slot] = 0.0

    def set_block(self, slot: int, block: int, rank: int, a: torch.Tensor, b_rows: list[tuple[int, torch.Tensor]],
                  scale: float) -> None:
        """Write one projection of an adapter into `slot`: A [rank, in] (this rank's inputs) into column block
        `block`, and each (output offset, rows [n, rank]) of B; the slot's scale is the adapter's."""
        cols = slice(block * rank, (block + 1) * rank)
        self.a[slot, cols].copy_(a)
        for offset, rows in b_rows:
            self.bt[slot, cols, offset:offset + rows.shape[0]].copy_(rows.T)
            first, end = self.block_rows[block].tolist()
            reach = (offset, offset + rows.shape[0]) if end <= first else \
                (min(first, offset), max(end, offset + rows.shape[0]))
            self.block_rows[block] = torch.tensor(reach)
        self.widths[slot] = max(self.widths[slot], (block + 1) * rank)
        self.scales[slot] = scale
        self.slot_ranks[slot], self.slot_widths[slot], self.slot_scales[slot] = rank, self.widths[slot], scale

    def kernel_view(self) -> Lora | None:
        """The slots as the C kernel reads them (valid while this object lives: every tensor is updated in place),
        or None where it cannot: weights not float32 in CPU memory."""
        if self.a.dtype != torch.float32 or not cpu_kernels_apply(self.a):
            return None
        slots, width, in_features = self.a.shape
        return Lora(a=self.a.data_ptr(), bt=self.bt.data_ptr(), in_features=in_features,
                    out_features=self.bt.shape[2], width=width, blocks=self.num_blocks, slots=slots,
                    block_rows=self.block_rows.data_ptr(), ranks=self.slot_ranks.data_ptr(),
                    widths=self.slot_widths.data_ptr(), scales=self.slot_scales.data_ptr())

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x) plus each row's adapter delta, added in place."""
        groups = self.context.batch.groups
        if not groups:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if self._kernel_serves(x2, y2):
            cpu_lora.lora_apply(self._view, self.context.batch.row_slots, x2.contiguous(), y2)
            return y
        for slot, rows in groups:
            width = self.widths[slot]
            if width == 0:
                continue
            shrunk = x2[rows] @ self.a[slot, :width].T  # [n, width]
            delta = (shrunk @ self.bt[slot, :width]) * self.scales[slot]
            if isinstance(rows, slice):
                y2[rows] += delta
            else:
                y2.index_add_(0, rows, delta)
        return y

    def _kernel_serves(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether the C kernel adds this step's deltas: a few float32 rows in CPU memory, slots it reads."""
        slots = self.context.batch.row_slots
        if slots is None or x.shape[0] > KERNEL_ROWS or slots.shape[0] != x.shape[0] or not cpu_kernels_apply(x) \
                or x.dtype != torch.float32 or y.dtype != torch.float32 or not y.is_contiguous():
            return False
        if self._view is False:
            self._view = self.kernel_view() if cpu_lora.library() is not None else None
        return self._view is not None

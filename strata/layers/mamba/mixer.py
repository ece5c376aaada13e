"""Mamba2 mixer pieces shared by Mamba2 and PLaMo2: head-sharded parameters, per-request conv/SSM state in
slots, and the split of a step into decodes (one-step state update) and prefills (chunked scan per sequence).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import Collective, ParallelContext, StepSize, tp_collective
from strata.layers.linear import PackableLinear, _copy_checked
from strata.layers.mamba.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from strata.layers.mamba.ssd import discretize_dt, heads_by_group, ssd_chunk_scan_varlen
from strata.layers.mamba.state_update import selective_state_update

# The chunked scan's result does not depend on the chunk length beyond rounding; 64 is fastest on CPU.
SCAN_CHUNK_SIZE = 64

# A piece of a parameter along dim 0: (full size, number of units), e.g. (num_heads * head_dim, num_heads).
# Units are split evenly across TP ranks, or, when there are fewer units than ranks, each rank holds the
# single unit it reads (the KV-head rule: rank r holds unit r // (tp / units)).
Piece = tuple[int, int]


def units_per_rank(units: int, tp_size: int) -> int:
    if units % tp_size == 0:
        return units // tp_size
    if tp_size % units == 0:
        return 1
    raise ValueError(f"{units} units cannot be split across {tp_size} tensor-parallel ranks "
                     "(one must divide the other)")


def shard_units(tensor: torch.Tensor, units: int, pc: ParallelContext) -> torch.Tensor:
    """This rank's rows of `tensor`, whose dim 0 is made of `units` equal parts."""
    tp = pc.tp_size
    if tp == 1:
        return tensor
    size = tensor.shape[0] // units
    local = units_per_rank(units, tp)
    first = pc.tp_rank * local if units % tp == 0 else pc.tp_rank // (tp // units)
    return tensor.narrow(0, first * size, local * size)


def sharded_param(pieces: Sequence[Piece], trailing: tuple[int, ...], pc: ParallelContext, dtype: torch.dtype,
                  transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Parameter:
    """A parameter made of `pieces` along dim 0, each sharded by its units; `transform` maps the checkpoint
    tensor to the full unsharded layout first (e.g. a squeeze)."""
    local = [size // units * units_per_rank(units, pc.tp_size) for size, units in pieces]
    param = nn.Parameter(torch.empty((sum(local), *trailing), dtype=dtype), requires_grad=False)
    full_rows = sum(size for size, _ in pieces)

    def weight_loader(p: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if transform is not None:
            loaded = transform(loaded)
        if loaded.shape != (full_rows, *trailing):
            raise ValueError(f"expected {(full_rows, *trailing)}, checkpoint has {tuple(loaded.shape)}")
        parts = loaded.split([size for size, _ in pieces], dim=0)
        _copy_checked(p, torch.cat([shard_units(t, units, pc) for t, (_, units) in zip(parts, pieces, strict=True)]))

    param.weight_loader = weight_loader
    return param


class ShardedColumnLinear(PackableLinear):
    """Column-parallel linear (no bias) whose output is several head-sharded pieces, e.g. [z | x | B | C | dt]."""

    def __init__(self, in_features: int, pieces: Sequence[Piece], pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.pc, self.pieces = pc, tuple(pieces)
        self.weight = sharded_param(pieces, (in_features,), pc, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, None)

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]:
        """Each piece's rows of this rank, as `shard_units` picks them (quantized tensors shard the same way)."""
        tp, rank = self.pc.tp_size, self.pc.tp_rank
        out, offset, start = [], 0, 0
        for size, units in self.pieces:
            local = units_per_rank(units, tp)
            first = rank * local if units % tp == 0 else rank // (tp // units)
            unit_size = size // units
            out.append((offset, start + first * unit_size, local * unit_size))
            offset, start = offset + local * unit_size, start + size
        return out


class ConvWeights(nn.Module):
    """Depthwise conv1d weight [C, K] (checkpoint layout [C, 1, K]) and optional bias, channels sharded by pieces."""

    def __init__(self, pieces: Sequence[Piece], width: int, bias: bool, pc: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = sharded_param(pieces, (width,), pc, dtype, transform=_squeeze_middle)
        self.bias = sharded_param(pieces, (), pc, dtype) if bias else None


def _squeeze_middle(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(1) if t.dim() == 3 else t


class GatedRMSNorm(nn.Module):
    """Mamba2's norm before out_proj: rms(y * silu(z)) * w, per group of channels.

    When a group spans TP ranks (a single group, split by heads), the sum of squares is all-reduced.
    """

    def __init__(self, channels: int, groups: int, num_heads: int, eps: float, pc: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.pc, self.eps = pc, eps
        self.group_size = channels // groups
        self.split_group = groups % pc.tp_size != 0
        self.weight = sharded_param([(channels, num_heads)], (), pc, dtype)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        if self.split_group:
            sq = self.pc.all_reduce(h.pow(2).sum(-1, keepdim=True))
            h = h * torch.rsqrt(sq / self.group_size + self.eps)
        else:
            g = h.view(*h.shape[:-1], -1, self.group_size)
            h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        return self.weight * h.to(dtype)

    def collectives(self, step: StepSize) -> list[Collective]:
        """A split group's sum of squares: one float32 per token."""
        return tp_collective(self.pc, "all_reduce", step.num_tokens, torch.float32) if self.split_group else []


@dataclass(frozen=True)
class MambaBatch:
    """How one step's sequences use their state slots; built once per step by the runner, on the host.

    Sequences come decodes first (one token each), then prefill chunks.
    """

    num_decodes: int
    decode_slots: torch.Tensor  # [D]
    prefill_slots: torch.Tensor  # [S - D]
    prefill_query_start: torch.Tensor  # [S - D + 1] token offsets within the prefill tokens
    fresh_slots: torch.Tensor | None  # slots of sequences starting from their first token
    decode_span: tuple[int, int] | None  # (first, end) when the decode slots are consecutive, ascending
    kernels: str = "torch"  # "triton": the Triton kernels, reading and writing the slots in place
    prefill_has_initial_state: torch.Tensor | None = None  # [S - D] bool (Triton path)
    scan_chunks: Any = None  # the Triton scan's chunk layout (strata.kernels.triton.ssd.ScanChunks)


@functools.cache
def _triton() -> SimpleNamespace:
    """The Triton kernels, imported on first use: Triton decides at import whether they run in its CPU
    interpreter (TRITON_INTERPRET=1), which must be set by then."""
    from strata.kernels.triton import causal_conv1d, ssd, state_update

    return SimpleNamespace(conv_varlen=causal_conv1d.causal_conv1d_varlen,
                           conv_update=causal_conv1d.causal_conv1d_update, scan=ssd.ssd_chunk_scan_varlen,
                           state_update=state_update.selective_state_update)


class MambaState(nn.Module):
    """This rank's conv and SSM state of one Mamba layer, one slot per live request, and the two kernels
    that read and write it. The model runner binds `conv_state` [slots, C, K-1] and `ssm_state` [slots, H, P, N].
    """

    def __init__(self, conv_channels: int, conv_width: int, num_heads: int, head_dim: int, state_size: int,
                 dt_limit: tuple[float, float] = (0.0, math.inf)) -> None:
        super().__init__()
        self.conv_channels, self.conv_width = conv_channels, conv_width
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_channels, self.conv_width - 1

    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.state_size

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             batch: MambaBatch) -> torch.Tensor:
        """silu(causal depthwise conv) of x [T, C], continuing each sequence from its slot."""
        if batch.fresh_slots is not None:
            # The conv runs first in every Mamba layer: a reused slot holds an earlier request's state.
            self.conv_state.index_fill_(0, batch.fresh_slots, 0)
            self.ssm_state.index_fill_(0, batch.fresh_slots, 0)
        if batch.kernels == "triton":
            return self._conv_triton(x, weight, bias, batch)
        nd = batch.num_decodes
        outs = []
        if nd and batch.decode_span:
            outs.append(self._conv_decode_in_place(x[:nd], weight, bias, batch.decode_span))
        elif nd:
            outs.append(causal_conv1d_update(x[:nd], self.conv_state, weight, bias, "silu", batch.decode_slots))
        if x.shape[0] > nd:
            out, final = causal_conv1d_varlen(x[nd:], weight, bias, batch.prefill_query_start,
                                              self.conv_state[batch.prefill_slots], None, "silu")
            self.conv_state[batch.prefill_slots] = final
            outs.append(out)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, z: torch.Tensor | None, dt_bias: torch.Tensor, batch: MambaBatch) -> torch.Tensor:
        """The selective SSM over x [T, H, P] (dt [T, H], B/C [T, G, N], z [T, H, P] or None), from and to
        each sequence's slot. Returns y [T, H, P]."""
        if batch.kernels == "triton":
            return self._scan_triton(x, dt, A, B, C, D, z, dt_bias, batch)
        nd = batch.num_decodes
        outs = []
        if nd and self.ssm_state.dtype == torch.float32:
            outs.append(self._decode_in_place(x[:nd], dt[:nd], A, B[:nd], C[:nd], D, None if z is None else z[:nd],
                                              dt_bias, batch))
        elif nd:
            outs.append(selective_state_update(
                self.ssm_state, x[:nd], dt[:nd], A, B[:nd], C[:nd], D, None if z is None else z[:nd], dt_bias,
                True, self.dt_limit, batch.decode_slots))
        if x.shape[0] > nd:
            y, final = ssd_chunk_scan_varlen(
                x[nd:], dt[nd:], A, B[nd:], C[nd:], SCAN_CHUNK_SIZE, batch.prefill_query_start,
                self.ssm_state[batch.prefill_slots], D, None if z is None else z[nd:], dt_bias, True, self.dt_limit)
            self.ssm_state[batch.prefill_slots] = final.to(self.ssm_state.dtype)
            outs.append(y)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


    def _conv_triton(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     batch: MambaBatch) -> torch.Tensor:
        """`conv` through the Triton kernels: decodes and prefills each in one launch, slots in place (fresh
        sequences start from zeros whatever their slot holds, so nothing is cleared)."""
        kernels, nd = _triton(), batch.num_decodes
        out = torch.empty_like(x)
        if nd:
            out[:nd] = kernels.conv_update(x[:nd], self.conv_state, weight, bias, "silu", batch.decode_slots)
        if x.shape[0] > nd:
            out[nd:] = kernels.conv_varlen(x[nd:], weight, bias, batch.prefill_query_start, self.conv_state,
                                           batch.prefill_slots, batch.prefill_has_initial_state, "silu")
        return out

    def _scan_triton(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor, z: torch.Tensor | None, dt_bias: torch.Tensor, batch: MambaBatch) -> torch.Tensor:
        """`scan` through the Triton kernels: the decodes' state update and the prefills' chunked scan, in place."""
        kernels, nd = _triton(), batch.num_decodes
        y = torch.empty_like(x)
        if nd:
            y[:nd] = kernels.state_update(self.ssm_state, x[:nd], dt[:nd], A, B[:nd], C[:nd], D,
                                          None if z is None else z[:nd], dt_bias, True, self.dt_limit,
                                          batch.decode_slots)
        if x.shape[0] > nd:
            y[nd:] = kernels.scan(x[nd:], dt[nd:], A, B[nd:], C[nd:], batch.scan_chunks, self.ssm_state,
                                  batch.prefill_slots, batch.prefill_has_initial_state, D,
                                  None if z is None else z[nd:], dt_bias, True, self.dt_limit)
        return y

    def _conv_decode_in_place(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              span: tuple[int, int]) -> torch.Tensor:
        """`causal_conv1d_update` for consecutive slots, on the [K-1, C] planes the states are stored as."""
        rows = self.conv_state[span[0]:span[1]].transpose(1, 2)  # [B, K-1, C], each plane contiguous
        w = weight.float()
        u = x.float() * w[:, -1]
        for k in range(rows.shape[1]):
            u.addcmul_(rows[:, k].float(), w[:, k])
        for k in range(rows.shape[1] - 1):  # ascending: each plane is read before it is overwritten
            rows[:, k].copy_(rows[:, k + 1])
        rows[:, -1].copy_(x)
        if bias is not None:
            u += bias.float()
        return F.silu(u).to(x.dtype)

    def _decode_in_place(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         D: torch.Tensor, z: torch.Tensor | None, dt_bias: torch.Tensor,
                         batch: MambaBatch) -> torch.Tensor:
        """One recurrence step for float32 states, updated where they lie when the slots are consecutive.

        The same math as `selective_state_update`, in three passes over the states instead of many: decode
        time is dominated by streaming the states through memory.
        """
        num, heads, p, n = x.shape[0], self.num_heads, self.head_dim, self.state_size
        span = batch.decode_span
        rows = self.ssm_state[span[0]:span[1]] if span else self.ssm_state.index_select(0, batch.decode_slots)
        delta = discretize_dt(dt, dt_bias, True, self.dt_limit)  # [B, H] float32
        xf = x.float()
        rows.mul_(torch.exp(delta * A)[:, :, None, None])
        flat = rows.view(num * heads, p, n)
        flat.baddbmm_((delta[:, :, None] * xf).reshape(-1, p, 1), heads_by_group(B.float(), heads).reshape(-1, 1, n))
        # C_t S^T rather than S C_t: the same numbers, but far faster as a batched GEMM on CPU.
        y = torch.bmm(heads_by_group(C.float(), heads).reshape(-1, 1, n), flat.transpose(1, 2)).view(num, heads, p)
        if not span:
            self.ssm_state.index_copy_(0, batch.decode_slots, rows)
        y.addcmul_(xf, D[:, None])
        if z is not None:
            y.mul_(F.silu(z.float()))
        return y.to(x.dtype)


def state_bytes_per_slot(layers: Sequence[MambaState], conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    """What one state slot (one sequence) costs over these layers: conv state plus SSM state."""
    conv, ssm = (torch.empty((), dtype=d).element_size() for d in (conv_dtype, ssm_dtype))
    return sum(math.prod(m.conv_state_shape()) * conv + math.prod(m.ssm_state_shape()) * ssm for m in layers)


def allocate_states(layers: Sequence[MambaState], num_slots: int, conv_dtype: torch.dtype,
                    ssm_dtype: torch.dtype, device: torch.device) -> int:
    """Bind each layer's state tensors; returns their bytes.

    Left uninitialised (untouched memory costs nothing): a slot is zeroed when a request starts in it.
    """
    total = 0
    for layer in layers:
        channels, width = layer.conv_state_shape()
        # Stored [slots, K-1, C] (vLLM's layout), seen as [slots, C, K-1]: a decode step then updates whole planes.
        layer.conv_state = torch.empty((num_slots, width, channels), dtype=conv_dtype, device=device).transpose(1, 2)
        layer.ssm_state = torch.empty((num_slots, *layer.ssm_state_shape()), dtype=ssm_dtype, device=device)
        total += layer.conv_state.nbytes + layer.ssm_state.nbytes
    return total

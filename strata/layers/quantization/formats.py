"""Each checkpoint format's tensors of one linear layer: their layout (which dimension holds the outputs and
which the inputs, and how many of them one stored element covers), and how they unpack into the canonical
weight-only form (q unsigned [N, K], scales and zero points [N, groups]) that `pack_weight` takes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.config.quant_config import AWQ, FP8, GPTQ, INT8_W8A8, PACKED, LinearScheme

# AWQ packs 8 nibbles into an int32 in this order of output columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class TensorLayout:
    """Where a stored tensor's outputs (N) and inputs (K) lie; `*_div` outputs/inputs per stored element along
    that dimension (the packing factor, or the group size for scales). dim None: the tensor spans all of them
    (a per-channel scale has one column), so it is not split."""

    dtype: torch.dtype
    out_dim: int | None
    out_div: int
    in_dim: int | None
    in_div: int
    per_tensor: bool = False  # one value for the whole checkpoint tensor, spread over its output rows


@dataclass(frozen=True)
class Canonical:
    q: torch.Tensor  # unsigned integer values [N, K]
    scales: torch.Tensor  # [N, groups]
    zeros: torch.Tensor | None  # [N, groups], unsigned domain; None = symmetric
    perm: torch.Tensor | None  # input order the groups assume (activation ordering), None = as given


def layouts(s: LinearScheme, in_features: int) -> dict[str, TensorLayout]:
    """The tensors (by name suffix after the layer's name) a layer of scheme `s` stores."""
    group = s.group_size if s.group_size > 0 and s.group_size < in_features else 0
    g_dim = 1 if group else None
    pf = s.pack_factor
    if s.format == PACKED:
        out = {"weight_packed": TensorLayout(torch.int32, 0, 1, 1, pf),
               "weight_scale": TensorLayout(torch.float32, 0, 1, g_dim, group or 1),
               "weight_shape": TensorLayout(torch.int64, None, 1, None, 1)}
        if not s.symmetric:
            out["weight_zero_point"] = TensorLayout(torch.int32, 0, pf, g_dim, group or 1)
        if s.act_order:
            out["weight_g_idx"] = TensorLayout(torch.int32, None, 1, 0, 1)
        return out
    if s.format in (INT8_W8A8, FP8):
        dtype = torch.int8 if s.format == INT8_W8A8 else torch.float8_e4m3fn
        return {"weight": TensorLayout(dtype, 0, 1, 1, 1),
                "weight_scale": TensorLayout(torch.float32, 0, 1, None, 1, per_tensor=s.group_size == 0)}
    g_dim = 0 if group else None
    if s.format == GPTQ:
        return {"qweight": TensorLayout(torch.int32, 1, 1, 0, pf),
                "qzeros": TensorLayout(torch.int32, 1, pf, g_dim, group or 1),
                "scales": TensorLayout(torch.float32, 1, 1, g_dim, group or 1),
                "g_idx": TensorLayout(torch.int32, None, 1, 0, 1)}
    assert s.format == AWQ, s.format
    return {"qweight": TensorLayout(torch.int32, 1, 8, 0, 1),
            "qzeros": TensorLayout(torch.int32, 1, 8, g_dim, group or 1),
            "scales": TensorLayout(torch.float32, 1, 1, g_dim, group or 1)}


def unpack_int32(packed: torch.Tensor, bits: int, count: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Values packed along the last dimension, lowest bits first (or in `order`): [..., W] -> [..., count]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    if order is not None:  # value i of a word sits at position order.index(i)
        shifts = shifts[torch.tensor([order.index(i) for i in range(per_word)], device=packed.device)]
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :count]


def to_canonical(s: LinearScheme, t: dict[str, torch.Tensor], n: int, k: int) -> Canonical:
    """This rank's stored tensors of one layer (N outputs, K inputs) -> the canonical form."""
    if s.format == PACKED:
        q = unpack_int32(t["weight_packed"], s.bits, k)
        zeros = None
        if not s.symmetric:
            zeros = unpack_int32(t["weight_zero_point"].t(), s.bits, n).t()
        return _ordered(q, t["weight_scale"], zeros, t.get("weight_g_idx"))
    if s.format == INT8_W8A8:
        return Canonical(t["weight"].to(torch.int16) + 128, t["weight_scale"], None, None)
    if s.format == GPTQ:
        q = unpack_int32(t["qweight"].t(), s.bits, k)
        zeros = unpack_int32(t["qzeros"], s.bits, n).t()
        if s.zeros_minus_one:
            zeros = zeros + 1
        g_idx = t["g_idx"] if s.act_order else None
        return _ordered(q, t["scales"].t(), zeros, g_idx)
    assert s.format == AWQ, s.format
    q = unpack_int32(t["qweight"], 4, n, AWQ_ORDER).t()
    zeros = unpack_int32(t["qzeros"], 4, n, AWQ_ORDER).t()
    return Canonical(q, t["scales"].t(), zeros, None)


def _ordered(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             g_idx: torch.Tensor | None) -> Canonical:
    """With activation ordering each input row names its group: sort the rows by group so that groups are
    contiguous again; the layer then reads its inputs in that order."""
    if g_idx is None:
        return Canonical(q, scales, zeros, None)
    perm = torch.argsort(g_idx.long(), stable=True)
    groups = scales.shape[1]
    counts = torch.bincount(g_idx.long(), minlength=groups)
    if bool((counts != counts[0]).any()):
        raise ValueError("g_idx does not give every group the same number of input rows")
    if bool((perm == torch.arange(len(perm))).all()):
        perm = None
    return Canonical(q if perm is None else q[:, perm], scales, zeros, perm)

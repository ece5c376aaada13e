"""Weight-only quantized linear weights: w = (q - zero) * scale per output row and group of inputs.

A plain-torch stand-in with the interface of the CPU kernels' module (it dequantizes per call); those kernels
replace this file.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int
    group_size: int  # inputs per scale; -1 = one scale per output channel
    out_features: int
    in_features: int
    nbytes: int
    q: torch.Tensor  # uint8 [N, K] (4-bit: two values a byte, [N, ceil(K/2)], low nibble first)
    scales: torch.Tensor  # float32 [N, groups]
    zeros: torch.Tensor | None  # float32 [N, groups] in the unsigned domain; None = 2^(bits-1)


def pack_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group_size: int) -> QuantizedWeight:
    """q: int [N, K] with unsigned values 0..2^bits-1; scales (and zeros) [N, K // group_size] or [N, 1]."""
    n, k = q.shape
    q = q.to(torch.uint8)
    if bits == 4:
        q = F.pad(q, (0, k % 2))
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    scales = scales.float().contiguous()
    zeros = None if zeros is None else zeros.float().contiguous()
    nbytes = sum(t.numel() * t.element_size() for t in (q, scales, zeros) if t is not None)
    return QuantizedWeight(bits, group_size, n, k, nbytes, q.contiguous(), scales, zeros)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 [N, K] weight."""
    q = w.q
    if w.bits == 4:
        q = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(1)[:, :w.in_features]
    group = w.in_features if w.group_size == -1 else w.group_size
    zeros = w.zeros if w.zeros is not None else torch.full_like(w.scales, 2 ** (w.bits - 1))
    expand = lambda t: t.repeat_interleave(group, dim=1)[:, :w.in_features]
    return (q.float() - expand(zeros)) * expand(w.scales)


def weight_only_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize(w).to(x.dtype), bias)

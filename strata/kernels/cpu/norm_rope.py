"""Bindings of the row-wise kernels around attention (csrc/rms_norm.c, rotary.c): RMSNorm, optionally fused with the
residual add, over rows or over each head, and half-split rotary embeddings turned in place; a prefill's rows shared
among the threads."""
from __future__ import annotations

import ctypes
import functools

import torch

from strata.kernels.cpu import build
from strata.kernels.cpu.abi import DTYPE_FLAGS, F32, I32, I64, PTR


@functools.cache
def rms_norm_library() -> ctypes.CDLL | None:
    return build.bind("rms_norm", {"rms_norm": ([PTR] * 5 + [I64, I64, F32, I32], None),
                                   "rms_norm_heads": ([PTR, I64, I64, I64, I64, PTR, F32, I32], None)})


@functools.cache
def rotary_library() -> ctypes.CDLL | None:
    return build.bind("rotary", {"rope_half_split": ([PTR, I64, I64, I64, I64, I64, PTR, PTR, I32], None)})


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x [T, H] contiguous (+ residual of its shape and dtype), weight of x's dtype: norm(x) without residual, else
    (norm(x + residual), x + residual)."""
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    rms_norm_library().rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                                out.data_ptr(), None if summed is None else summed.data_ptr(), x.shape[0], x.shape[1],
                                eps, DTYPE_FLAGS[x.dtype])
    return out if residual is None else (out, summed)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of x [T, H, D] (each head contiguous) normalized, in a copy."""
    out = x.contiguous() if not x.is_contiguous() else x.clone()
    rms_norm_library().rms_norm_heads(out.data_ptr(), out.shape[0], out.shape[1], out.shape[2], out.stride(0),
                                      weight.data_ptr(), eps, DTYPE_FLAGS[x.dtype])
    return out


def rope_half_split(x: torch.Tensor, head_dim: int, rotary_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Turns the first `rotary_dim` dimensions of each head of x [T, H, head_dim] in place (half-split pairs) by cos
    and sin [T, rotary_dim / 2] contiguous, of x's dtype."""
    rotary_library().rope_half_split(x.data_ptr(), x.shape[0], x.shape[1], head_dim, rotary_dim, x.stride(0),
                                     cos.data_ptr(), sin.data_ptr(), DTYPE_FLAGS[x.dtype])

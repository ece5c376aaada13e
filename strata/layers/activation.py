"""Activations of gated MLPs; the few rows of a decode step on CPU go through a small C kernel (one call instead
of three torch ops)."""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from strata import native
from strata.native import I32, I64, PTR

KERNEL_ROWS = 16  # a decode step's; prefill keeps torch's vectorized, threaded ops
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native.bind("activation", {"silu_and_mul": ([PTR, PTR, I64, I64, I32], None)})


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] tensor."""
    if (gate_up.device.type == "cpu" and gate_up.dim() == 2 and gate_up.shape[0] <= KERNEL_ROWS
            and gate_up.dtype in _DTYPES and gate_up.is_contiguous() and _library() is not None):
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        _library().silu_and_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
                                _DTYPES[gate_up.dtype])
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

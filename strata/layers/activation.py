"""Activations of gated MLPs; on CPU through a small C kernel (one call instead of three torch ops, a prefill's rows
shared among the threads)."""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from strata import native
from strata.native import I32, I64, PTR

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _library() -> ctypes.CDLL | None:
    signature = ([PTR, PTR, I64, I64, I32], None)
    return native.bind("activation", {"silu_and_mul": signature, "gelu_tanh_and_mul": signature})


def _kernel(name: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    """The C kernel's [gate | up] -> activation(gate) * up, or None where it does not serve (not CPU, not 2-D)."""
    if (gate_up.device.type == "cpu" and gate_up.dim() == 2
            and gate_up.dtype in _DTYPES and gate_up.is_contiguous() and _library() is not None):
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        getattr(_library(), name)(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
                                  _DTYPES[gate_up.dtype])
        return out
    return None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] tensor."""
    out = _kernel("silu_and_mul", gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gate: tanh-approximated GELU of the gate half times the up half."""
    out = _kernel("gelu_tanh_and_mul", gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up

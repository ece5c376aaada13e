"""Bindings of the gated activations (csrc/activation.c): [gate | up] -> activation(gate) * up in one call, a
prefill's rows shared among the threads."""
from __future__ import annotations

import ctypes
import functools

import torch

from strata.kernels.cpu import build
from strata.kernels.cpu.abi import DTYPE_FLAGS, I32, I64, PTR

GATES = ("silu_and_mul", "gelu_tanh_and_mul")


@functools.cache
def library() -> ctypes.CDLL | None:
    signature = ([PTR, PTR, I64, I64, I32], None)
    return build.bind("activation", dict.fromkeys(GATES, signature))


def gated(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    """The gate `name` (one of GATES) of gate_up [T, 2I] contiguous, float32 or bfloat16: [T, I]."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    getattr(library(), name)(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], DTYPE_FLAGS[gate_up.dtype])
    return out

"""Activations of gated MLPs; on CPU through a small C kernel (one call instead of three torch ops, a prefill's rows
shared among the threads)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.cpu import activation as activation_kernels
from strata.kernels.cpu import cpu_kernels_apply
from strata.kernels.cpu.abi import DTYPE_FLAGS


def _kernel(name: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    """The C kernel's [gate | up] -> activation(gate) * up, or None where it does not serve (not CPU, not 2-D)."""
    if (cpu_kernels_apply(gate_up) and gate_up.dim() == 2
            and gate_up.dtype in DTYPE_FLAGS and gate_up.is_contiguous() and activation_kernels.library() is not None):
        return activation_kernels.gated(name, gate_up)
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

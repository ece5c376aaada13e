"""Gated activations: the C kernels (a decode step's rows, or a prefill's shared among the threads) give
silu(gate) * up and gelu_tanh(gate) * up as torch computes them in float64 (torch's own float32 GELU loses digits to
1 + tanh(u)'s cancellation at negative gates)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import activation as activation_kernels
from strata.layers.activation import gelu_tanh_and_mul, silu_and_mul

GATES = {"silu": (silu_and_mul, F.silu), "gelu_tanh": (gelu_tanh_and_mul, lambda g: F.gelu(g, approximate="tanh"))}


@pytest.mark.parametrize("kind", list(GATES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 32, 100])
def test_gated_activation_matches_torch_in_float64(kind, dtype, rows):
    if activation_kernels.library() is None:
        pytest.skip("no C compiler")
    ours, torch_gate = GATES[kind]
    gate_up = (torch.randn(rows, 2 * 1000, generator=torch.Generator().manual_seed(rows)) * 6).to(dtype)
    gate_up[0, :5] = torch.tensor([-200.0, 200.0, 0.0, -1e-8, -3.0]).to(dtype)  # saturated, zero, negative gates
    got = ours(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = torch_gate(gate) * up
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    else:  # the kernel rounds twice (after the activation, after the product): within two bfloat16 steps
        torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-6)

"""SwiGLU: the C kernel of decode steps gives torch's silu(gate) * up."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.layers import activation
from strata.layers.activation import silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, activation.KERNEL_ROWS, activation.KERNEL_ROWS + 1])
def test_silu_and_mul_matches_torch_on_both_paths(dtype, rows):
    if activation._library() is None:
        pytest.skip("no C compiler")
    gate_up = (torch.randn(rows, 2 * 1000, generator=torch.Generator().manual_seed(rows)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -1e-8]).to(dtype)  # saturated and zero gates
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = silu_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # one bfloat16 rounding step at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)

"""RMSNorm: the C kernel gives what the torch ops give (with and without the residual add), on a decode step's few rows
and on a prefill's many, which it shares among the threads."""
from __future__ import annotations

import pytest
import torch

from strata.kernels.cpu import norm_rope
from strata.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 31, 32, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_the_torch_ops(dtype, rows, with_residual, monkeypatch):
    if norm_rope.rms_norm_library() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(rows)
    layer = RMSNorm(1000, 1e-5, dtype)
    layer.weight.data = torch.randn(1000, generator=g).to(dtype)
    x, residual = (torch.randn(rows, 1000, generator=g).to(dtype) for _ in range(2))
    calls = []
    kernel = layer._kernel
    monkeypatch.setattr(layer, "_kernel", lambda *a: calls.append(1) or kernel(*a))
    got = layer(x, residual if with_residual else None)
    assert calls
    summed = x + residual if with_residual else x
    want = layer.normalize(summed)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if with_residual:
        got, got_sum = got
        assert torch.equal(got_sum, summed)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_rms_norm_of_heads_matches_the_torch_ops_at_prefill_size():
    if norm_rope.rms_norm_library() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    layer = RMSNorm(64, 1e-6)
    layer.weight.data = torch.randn(64, generator=g)
    qkv = torch.randn(100, 12 * 64, generator=g)
    q = qkv[:, :8 * 64].view(100, 8, 64)  # heads of a qkv output: rows 12 heads apart
    assert layer._heads_kernel_serves(q)
    torch.testing.assert_close(layer(q), layer.normalize(q), rtol=1e-5, atol=1e-5)

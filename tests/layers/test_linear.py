"""`linear` on CPU: plain float32 / bfloat16 weights through the C kernel (few rows) or oneDNN (more rows)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.layers import linear as linear_module
from strata.layers.linear import SMALL_BATCH_DENSE, linear
from strata.layers.quantization import cpu_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_on_either_path(dtype, rows, bias, monkeypatch):
    if not cpu_matmul.available():
        pytest.skip("no C compiler")
    calls = []
    kernel = cpu_matmul.matmul
    monkeypatch.setattr(cpu_matmul, "matmul", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(77, 100, generator=g) * 0.1).to(dtype)  # neither dimension a multiple of 32
    b = torch.randn(77, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 100, generator=g).to(dtype)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, 77)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert bool(calls) == (rows <= SMALL_BATCH_DENSE)


def test_linear_keeps_leading_dimensions_and_runs_without_the_kernel(monkeypatch):
    x, w = torch.randn(1, 2, 40), torch.randn(9, 40)
    with_kernel = linear(x, w)
    monkeypatch.setattr(cpu_matmul, "_library", lambda: None)
    assert linear_module.linear(x, w).shape == with_kernel.shape == (1, 2, 9)
    torch.testing.assert_close(linear(x, w), with_kernel, rtol=1e-5, atol=1e-5)

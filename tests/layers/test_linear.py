"""`linear` on CPU: a packed weight (oneDNN's layout) through the blocked C kernel (few rows) or oneDNN (more rows),
a plain one (a tied LM head's table) through the plain C kernel or oneDNN; all give F.linear's product."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.crossovers import SMALL_BATCH_DENSE, SMALL_BATCH_PLAIN
from strata.layers import linear as linear_module
from strata.layers import onednn_weights
from strata.layers.linear import linear

DTYPES = [torch.float32] + ([torch.bfloat16] if onednn_weights.can_pack(torch.zeros(1, dtype=torch.bfloat16))
                            else [])


def _spy(monkeypatch, module, name) -> list:
    calls, kernel = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [True, False])
def test_linear_matches_f_linear_on_every_path(dtype, rows, bias, packed, monkeypatch):
    if not cpu_matmul.available() or cpu_matmul.blocked_library() is None:
        pytest.skip("no C compiler")
    blocked, plain = _spy(monkeypatch, onednn_weights, "small_batch_linear"), _spy(monkeypatch, cpu_matmul, "matmul")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(77, 100, generator=g) * 0.1).to(dtype)  # neither dimension a multiple of a block
    b = torch.randn(77, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 100, generator=g).to(dtype)
    weight = onednn_weights.pack(w) if packed else w
    if packed:
        assert weight.blocked_layout is not None
    blocked.clear()
    got = linear(x, weight, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, 77)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    small = rows <= SMALL_BATCH_DENSE
    assert (bool(blocked), bool(plain)) == ((small, False) if packed else (False, small))


def test_a_packed_weight_whose_layout_is_unknown_runs_onednn_for_every_batch(monkeypatch):
    monkeypatch.setattr(onednn_weights, "_BLOCKS", (8,))  # no candidate of that block size fits the buffer
    weight = onednn_weights.pack(torch.randn(70, 40))
    assert weight.blocked_layout is None
    x = torch.randn(1, 40)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight.to_dense()), rtol=1e-5, atol=1e-5)


def test_linear_keeps_leading_dimensions_and_runs_without_the_kernels(monkeypatch):
    x, w = torch.randn(1, 2, 40), torch.randn(9, 40)
    with_kernel = linear(x, onednn_weights.pack(w))
    monkeypatch.setattr(cpu_matmul, "weight_only_library", lambda: None)
    assert with_kernel.shape == linear(x, w).shape == (1, 2, 9)
    torch.testing.assert_close(linear(x, w), with_kernel, rtol=1e-5, atol=1e-5)


def test_a_layout_of_the_right_size_is_taken_only_if_it_reproduces_onednn(monkeypatch):
    weight = torch.randn(128, 64)
    real = onednn_weights.pack(weight).blocked_layout
    wrong = 32 if real.block == 64 else 64  # both fill exactly the same buffer for 128 outputs
    monkeypatch.setattr(onednn_weights, "_BLOCKS", (wrong, real.block))
    assert onednn_weights.pack(weight).blocked_layout == real


def _as_without_native_bfloat16(monkeypatch) -> None:
    """As on a CPU without native bfloat16 arithmetic: only float32 weights are packed for oneDNN."""
    monkeypatch.setattr(onednn_weights, "can_pack", lambda w: w.dtype == torch.float32)
    monkeypatch.setattr(linear_module, "can_pack", onednn_weights.can_pack)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, SMALL_BATCH_PLAIN, SMALL_BATCH_PLAIN + 1, 70])
def test_a_plain_bfloat16_weight_without_native_bfloat16_takes_the_kernel_or_the_gemm(x_dtype, rows, monkeypatch):
    if not cpu_matmul.available():
        pytest.skip("no C compiler")
    _as_without_native_bfloat16(monkeypatch)
    kernel, gemm = _spy(monkeypatch, cpu_matmul, "matmul"), _spy(monkeypatch, linear_module, "widened_linear")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(77, 100, generator=g) * 0.1).bfloat16()
    b = torch.randn(77, generator=g).bfloat16()
    x = torch.randn(rows, 100, generator=g).to(x_dtype)
    got = linear(x, w, b)
    assert got.dtype == x_dtype
    want = F.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert (bool(kernel), bool(gemm)) == (rows <= SMALL_BATCH_PLAIN, rows > SMALL_BATCH_PLAIN)


def test_a_plain_bfloat16_weight_without_native_bfloat16_still_runs_without_the_kernels(monkeypatch):
    _as_without_native_bfloat16(monkeypatch)
    monkeypatch.setattr(cpu_matmul, "gemm_library", lambda: None)
    w = torch.randn(30, 40).bfloat16()
    x = torch.randn(SMALL_BATCH_PLAIN + 3, 40)
    torch.testing.assert_close(linear(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def test_the_gemm_reads_a_bfloat16_weight_whose_rows_are_not_contiguous(monkeypatch):
    if not cpu_matmul.available():
        pytest.skip("no C compiler")
    _as_without_native_bfloat16(monkeypatch)
    w = torch.randn(40, 30).bfloat16().T  # a transposed view
    x = torch.randn(SMALL_BATCH_PLAIN + 3, 40)
    torch.testing.assert_close(linear(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-5)

"""The packed weight-only layout round-trips, and every kernel path matches dequantize-then-matmul."""
from __future__ import annotations

import pytest
import torch
from c_builds import BUILDS, cpu_flags, forced_build, gemm_engine

from strata.kernels.cpu import abi
from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.crossovers import SMALL_BATCH_WEIGHT_ONLY as SMALL_BATCH
from strata.layers.quantization.weight_only import (
    dequantize,
    pack_fp8,
    pack_weight,
    unpack,
    weight_only_linear,
)


def _random_weight(n: int, k: int, bits: int, group_size: int, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = None if symmetric else torch.randint(0, 1 << bits, (n, groups), generator=g).float()
    return q, scales, zeros


def _reference(q, scales, zeros, bits, group_size):
    k = q.shape[1]
    group = k if group_size == -1 else group_size
    s = scales.repeat_interleave(group, dim=1)[:, :k]
    z = (torch.full_like(s, float(1 << (bits - 1))) if zeros is None
         else zeros.repeat_interleave(group, dim=1)[:, :k])
    return (q.float() - z) * s


def _linear_on_threads(x: torch.Tensor, w, bias: torch.Tensor, threads: int) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return weight_only_linear(x, w, bias)
    finally:
        torch.set_num_threads(before)


def _assert_close_to(y: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within 1e-5 of the outputs' scale (float32 products; the VNNI kernel's 24-bit x is as exact)."""
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=tolerance, msg=lambda e: f"{what}: {e}")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_then_dequantize_gives_back_the_weight(bits, group_size, symmetric):
    q, scales, zeros = _random_weight(37, 200, bits, group_size, symmetric)
    w = pack_weight(q, scales, zeros, bits, group_size)
    assert torch.equal(unpack(w), q.to(torch.int32))
    torch.testing.assert_close(dequantize(w), _reference(q, scales, zeros, bits, group_size), rtol=0, atol=0)
    assert w.nbytes == w.packed.nbytes + w.scales.nbytes + (0 if zeros is None else w.zeros.nbytes)
    assert w.packed.shape == (37, 224 * bits // 8)


def test_pack_refuses_bad_bits_group_sizes_and_values():
    q, scales, zeros = _random_weight(8, 64, 4, 32, True)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        pack_weight(q, scales, zeros, 3, 32)
    with pytest.raises(ValueError, match="group size 48"):
        pack_weight(q, torch.rand(8, 2), None, 4, 48)
    with pytest.raises(ValueError, match="scales must be"):
        pack_weight(q, torch.rand(8, 3), None, 4, 32)
    with pytest.raises(ValueError, match="0..15"):
        pack_weight(q + 16, scales, None, 4, 32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 64, 300])
@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, True), (4, 64, False), (4, 96, False),
                                                       (4, 128, True), (4, -1, False), (8, 32, False), (8, 64, True),
                                                       (8, 128, False), (8, -1, True)])
def test_weight_only_linear_matches_dequantize_then_matmul(m, bits, group_size, symmetric, threads):
    n, k = 75, 200  # neither a multiple of 64; K ends in a partial block and (for 64/128) a partial group
    q, scales, zeros = _random_weight(n, k, bits, group_size, symmetric, seed=m)
    w = pack_weight(q, scales, zeros, bits, group_size)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    y = _linear_on_threads(x, w, bias, threads)
    reference = x.double() @ _reference(q, scales, zeros, bits, group_size).double().T + bias.double()
    _assert_close_to(y, reference, "weight_only_linear")


def _kernel_cases(n: int, k: int):
    """(kind, weight rows, scales, zeros, effective group, reference weight) for every kind the kernel reads."""
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(n, k, generator=g)
    yield abi.KIND_F32, dense, None, None, -1, dense
    yield abi.KIND_BF16, dense.bfloat16(), None, None, -1, dense.bfloat16().float()
    for bits, group_size, symmetric in [(4, 32, False), (4, 128, True), (4, -1, True), (8, 64, False),
                                        (8, -1, False)]:
        q, scales, zeros = _random_weight(n, k, bits, group_size, symmetric)
        w = pack_weight(q, scales, zeros, bits, group_size)
        kind = abi.KIND_INT4 if bits == 4 else abi.KIND_INT8
        yield kind, w.packed, w.scales, w.zeros, w.effective_group_size, _reference(q, scales, zeros, bits,
                                                                                      group_size)
    q, scales, zeros = _random_weight(n, k, 4, 64, False)
    zeros += 0.25  # zero points off the integers: no longer exact in bfloat16 once subtracted (AMX declines them)
    w = pack_weight(q, scales, zeros, 4, 64)
    yield abi.KIND_INT4, w.packed, w.scales, w.zeros, 64, _reference(q, scales, zeros, 4, 64)
    fp8 = pack_fp8(_random_fp8(n, k, 4), torch.rand(n, generator=g) + 0.5)
    yield abi.KIND_FP8, fp8.packed, fp8.scales, None, fp8.effective_group_size, dequantize(fp8)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 64, 300])
def test_small_batch_kernel_matches_the_reference_for_every_kind(m, threads):
    n, k = 45, 232
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind, weight, scales, zeros, group, reference in _kernel_cases(n, k):
            y = cpu_matmul.matmul(x, weight, kind, n, scales, zeros, group)
            _assert_close_to(y, x.double() @ reference.double().T, f"kind {kind}")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("engine", ["FMA", "AMX"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 5, 6, 17, 64, 300])
@pytest.mark.parametrize("n,k", [(45, 600), (130, 232), (130, 1312)])
def test_gemm_matches_the_reference_for_every_kind(m, n, k, threads, engine):
    """Rows in whole and partial blocks of 6 (AMX: of 16, in pairs, an odd last block), outputs in partial strips
    of 16 (pairs of strips, an odd one and a partial second of a pair) and (130) two tasks of 80, K in several
    panels of 256 ending in a partial block of 32 (600) or in one short panel (232); on AMX K in runs of 32 (600:
    a partial last run of bfloat16), groups of runs that straddle no scale, and (1312: 41 runs) two panels."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    before = torch.get_num_threads()
    with gemm_engine(engine):
        torch.set_num_threads(threads)
        try:
            for kind, weight, scales, zeros, group, reference in _kernel_cases(n, k):
                if kind == abi.KIND_F32:
                    continue  # float32 weights are oneDNN's
                y = cpu_matmul.narrow_gemm(x, weight, kind, n, scales, zeros, group, bias)
                _assert_close_to(y, x.double() @ reference.double().T + bias.double(), f"kind {kind}")
        finally:
            torch.set_num_threads(before)


# AVX-VNNI changes only the int8-activation GGUF kernels (test_gguf_int8_activations.py checks that build).
@pytest.mark.parametrize("build", sorted(set(BUILDS) - {"avx2_vnni"}))
def test_each_c_build_matches_the_reference(build, tmp_path, monkeypatch):
    with forced_build(build, tmp_path, monkeypatch), gemm_engine("AMX" if build == "amx" else "FMA"):
        _check_builds_products(build)


def _check_builds_products(build: str) -> None:
    before = torch.get_num_threads()
    try:
        for m, threads in [(1, 1), (3, 2), (11, 2)]:  # 11 rows of x: passes of 8, 2 and 1 rows; 6 and 5 in the GEMM
            torch.set_num_threads(threads)
            x = torch.randn(m, 232, generator=torch.Generator().manual_seed(m))
            for kind, weight, scales, zeros, group, reference in _kernel_cases(45, 232):
                expected = x.double() @ reference.double().T
                y = cpu_matmul.matmul(x, weight, kind, 45, scales, zeros, group)
                _assert_close_to(y, expected, f"{build}, kind {kind}, {m} rows")
                if kind != abi.KIND_F32:
                    y = cpu_matmul.narrow_gemm(x, weight, kind, 45, scales, zeros, group)
                    _assert_close_to(y, expected, f"{build} GEMM, kind {kind}, {m} rows")
    finally:
        torch.set_num_threads(before)


def test_amx_and_fma_gemms_sum_in_their_own_orders_and_both_match():
    """The AMX engine really runs when chosen: its products (x in three bfloat16 pieces, each group scaled once)
    round differently from the FMA GEMM's, and both stay within float32's error of the reference."""
    x = torch.randn(40, 600, generator=torch.Generator().manual_seed(0))
    for kind, weight, scales, zeros, group, reference in _kernel_cases(45, 600):
        if kind == abi.KIND_F32 or (zeros is not None and not torch.equal(zeros, zeros.round())):
            continue
        expected = x.double() @ reference.double().T
        products = {}
        for engine in ("FMA", "AMX"):
            with gemm_engine(engine):
                products[engine] = cpu_matmul.narrow_gemm(x, weight, kind, 45, scales, zeros, group)
            _assert_close_to(products[engine], expected, f"{engine}, kind {kind}")
        assert not torch.equal(products["FMA"], products["AMX"]), f"kind {kind}: AMX gave the FMA GEMM's bits"


def test_bfloat16_input_gives_bfloat16_output_close_to_float32():
    q, scales, zeros = _random_weight(40, 96, 4, 32, False)
    w = pack_weight(q, scales, zeros, 4, 32)
    x = torch.randn(2, 96)
    y = weight_only_linear(x.bfloat16(), w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), weight_only_linear(x.bfloat16().float(), w), rtol=1e-2, atol=1e-2)


def test_large_batches_take_the_gemm_and_match(monkeypatch):
    calls = []
    gemm = cpu_matmul.narrow_gemm
    monkeypatch.setattr(cpu_matmul, "narrow_gemm", lambda *a, **kw: calls.append(a[0].shape) or gemm(*a, **kw))
    q, scales, zeros = _random_weight(75, 200, 4, 64, False)
    w = pack_weight(q, scales, zeros, 4, 64)
    bias = torch.randn(75)
    for rows in (SMALL_BATCH, SMALL_BATCH + 1):
        x = torch.randn(rows, 200)
        reference = x.double() @ _reference(q, scales, zeros, 4, 64).double().T + bias.double()
        _assert_close_to(weight_only_linear(x, w, bias), reference, f"{rows} rows")
    assert calls == [(SMALL_BATCH + 1, 200)]


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, -1)])
def test_small_batch_kernel_is_far_more_exact_than_float16_activations(bits, group_size):
    """Whatever a kernel rounds x to (the VNNI kernel: 24-bit fixed point per 128 values) loses at least 100x
    less than the 16-bit activations W4A16/W8A16 allow, also with outlier channels."""
    g = torch.Generator().manual_seed(0)
    n, k = 256, 1024
    q, scales, _ = _random_weight(n, k, bits, group_size, True)
    w = pack_weight(q, scales, None, bits, group_size)
    weight = dequantize(w).double()
    for outliers, m in [(False, 1), (True, 1), (False, 4), (True, 4)]:  # one row: AVX2's int4 kernel rounds x
        x = torch.randn(m, k, generator=g)
        if outliers:
            x[:, ::97] *= 30
        reference = x.double() @ weight.T
        error = (weight_only_linear(x, w).double() - reference).norm() / reference.norm()
        float16_error = (x.half().double() @ weight.T - reference).norm() / reference.norm()
        assert error * 100 < float16_error, (outliers, error.item(), float16_error.item())


@pytest.mark.parametrize("bits", [4, 8])
def test_small_batch_kernel_passes_nan_and_infinity_through(bits):
    q, scales, _ = _random_weight(8, 256, bits, 128, True)
    w = pack_weight(q, scales, None, bits, 128)
    x = torch.randn(2, 256)
    x[0, 5], x[1, 200] = float("nan"), float("inf")
    assert not torch.isfinite(weight_only_linear(x, w)).any()
    for row in x:  # one row at a time: AVX2's int4 kernel rounds x to fixed point
        assert not torch.isfinite(weight_only_linear(row[None], w)).any()


@pytest.mark.parametrize("bits", [4, 8])
def test_small_batch_kernel_keeps_tiny_and_huge_activations_exact(bits):
    """x rounded to fixed point per block keeps its relative precision at magnitudes far from 1, subnormal ones too
    (except on VNNI CPUs, whose kernel's inverse scale overflows for blocks below about 1e-31)."""
    q, scales, _ = _random_weight(16, 256, bits, 128, True)
    w = pack_weight(q, scales, None, bits, 128)
    weight = dequantize(w).double()
    for magnitude in (1e-25, 1e30) + (() if "avx512_vnni" in cpu_flags() else (1e-39,)):
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(0)) * magnitude
        x[0, :128] *= 1e-3  # two x blocks, far apart
        reference = x.double() @ weight.T
        error = (weight_only_linear(x, w).double() - reference).abs().max() / reference.abs().max()
        assert error < 1e-5, (magnitude, error.item())


def _random_fp8(n: int, k: int, seed: int) -> torch.Tensor:
    """Every finite e4m3 code, subnormals and both zeros included (the NaN codes 0x7f / 0xff left out)."""
    codes = torch.randint(0, 254, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    codes = codes + (codes >= 0x7F).int()  # skip 0x7f; 0xfe + 1 = 0xff is never drawn
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def test_fp8_weights_widen_to_torchs_float8_values():
    weight = _random_fp8(40, 96, 0)
    scales = torch.rand(40) + 0.5
    w = pack_fp8(weight, scales)
    assert w.float8 and w.packed.dtype == torch.uint8 and w.nbytes == 40 * 96 + 40 * 4
    torch.testing.assert_close(dequantize(w), weight.float() * scales[:, None], rtol=0, atol=0)
    per_tensor = pack_fp8(weight, torch.tensor(0.25))
    torch.testing.assert_close(dequantize(per_tensor), weight.float() * 0.25, rtol=0, atol=0)


def test_fp8_weights_with_nan_or_wrong_scales_are_refused():
    weight = _random_fp8(8, 64, 1)
    with pytest.raises(ValueError, match="NaN"):
        pack_fp8(torch.where(torch.arange(64) == 5, torch.tensor(float("nan")), weight.float()).to(
            torch.float8_e4m3fn), torch.ones(8))
    with pytest.raises(ValueError, match="one per output channel"):
        pack_fp8(weight, torch.ones(3))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 64, 300])
def test_fp8_weight_only_linear_matches_dequantize_then_matmul(m, threads):
    n, k = 75, 200  # neither a multiple of 64; K ends in a partial block
    weight = _random_fp8(n, k, m)
    w = pack_fp8(weight, torch.rand(n) * 0.01 + 0.001)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    y = _linear_on_threads(x, w, bias, threads)
    _assert_close_to(y, x.double() @ dequantize(w).double().T + bias.double(), f"fp8 m={m}")

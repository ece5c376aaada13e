"""GGUF products with x rounded to 8 bits as llama.cpp rounds it (quantized_activations=int8, csrc/gguf_q8*.h): each
kernel against a float64 reference of the same rounded x (numpy, written from ggml-quants.c's quantize_row_q8_0_ref /
q8_1_ref / q8_K_ref), the weights dequantized by gguf-py, on the native, AVX2 (vpmaddubsw), AVX2 with AVX-VNNI,
AVX-512 VNNI and portable builds, from the GGUF blocks and from the tile layout loaded layers hold (gguf_q8_tiled.h);
ties rounded as llama.cpp rounds them; refusals."""
from __future__ import annotations

import gguf_packing as gp
import numpy as np
import pytest
import torch
from c_builds import cpu_flags, forced_build

from strata.errors import ConfigError
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.quantization import gguf_quants

INT8_TYPES = (gp.Q4_0, gp.Q4_1, gp.Q5_0, gp.Q5_1, gp.Q8_0, gp.Q4_K, gp.Q5_K, gp.Q6_K)
NAMES = {t: gguf_quants.TYPES[t].name for t in INT8_TYPES}
_WITH_MIN = (gp.Q4_1, gp.Q5_1)


def _round_q8_32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_1_ref on rows of x: (q int [..., K], d as its fp16 [..., K/32], s = fp16(sum q * d))."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (blocks * inv[..., None]).astype(np.float32).astype(np.float64)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int64)  # roundf: halves away from zero
    s = (q.sum(axis=-1).astype(np.float32) * d).astype(np.float16).astype(np.float64)
    return q.reshape(x.shape), d.astype(np.float16).astype(np.float64), s


def _round_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref on rows of x: (q int [..., K], d float32 [..., K/256]); scale from the signed value of
    largest magnitude (its first occurrence), nearest_int's ties to even, q at most 127."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 256)
    first = np.abs(blocks).argmax(axis=-1)
    largest = np.take_along_axis(blocks, first[..., None], axis=-1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(largest != 0, np.float32(-127) / largest, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint((blocks * iscale[..., None]).astype(np.float32)), 127).astype(np.int64)
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float64)
    return q.reshape(x.shape), d


def _half(data: np.ndarray, offset: int) -> np.ndarray:
    return data[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def reference(x: np.ndarray, data: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """(y, the sum of |terms| for the tolerance) of x [M, K] rounded as llama.cpp rounds it for `qtype`, times the
    weight gguf-py dequantizes, in float64: sum over blocks of (weight . x's integer q) * x's d; Q4_1 / Q5_1's mins
    meet Q8_1's stored s, as ggml's vec_dot does."""
    n, k = data.shape[0], x.shape[1]
    weight = gp.reference(data, qtype).astype(np.float64)  # [N, K]
    per = 32 if gguf_quants.TYPES[qtype].values_per_block == 32 else 256
    if per == 32:
        q, d, s = _round_q8_32(x)
    else:
        (q, d), s = _round_q8_k(x), None
    xv = q.astype(np.float64) * np.repeat(d, per, axis=-1)  # the rounded x, exactly (an int8 times a float)
    y, size = xv @ weight.T, np.abs(xv) @ np.abs(weight).T
    if qtype in _WITH_MIN:  # the weight's m times Q8_1's fp16 s, not times x's own sum
        blocks = data.reshape(n, k // 32, -1)
        m = _half(blocks, 2)  # [N, K/32]
        xsum = xv.reshape(x.shape[0], -1, 32).sum(axis=-1)  # [M, K/32]
        y += s @ m.T - xsum @ m.T
    return y, size


def _product(x: torch.Tensor, data: np.ndarray, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gguf_quants.gguf_linear(x, torch.from_numpy(data), qtype, x.shape[1], bias, activations="int8")


def _tiles(data: np.ndarray, qtype: int, k: int) -> torch.Tensor | None:
    return cpu_matmul.tile_for_int8(torch.from_numpy(data), gguf_quants.kernel_kind(qtype), k)


def _tiled_product(x: torch.Tensor, data: np.ndarray, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product with the weight laid out as a loaded layer holds it (the build must have the layout)."""
    tiles = _tiles(data, qtype, x.shape[1])
    assert tiles is not None, f"no tile layout for {NAMES[qtype]} in this build"
    return gguf_quants.tiled_linear(x, tiles, qtype, x.shape[1], data.shape[0], bias)


def _check(qtype: int, m: int, k: int, seed: int, what: str, bias: bool = False, product=_product) -> None:
    data = gp.random_blocks(qtype, 21, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) + (2.0 if m % 2 else 0.0)
    b = torch.randn(21, generator=torch.Generator().manual_seed(seed + 1)) if bias else None
    _compare(x, data, qtype, what, b, product)


def _compare(x: torch.Tensor, data: np.ndarray, qtype: int, what: str, b: torch.Tensor | None = None,
             product=_product) -> None:
    y = product(x, data, qtype, b)
    expected, size = reference(x.numpy(), data, qtype)
    if b is not None:
        expected = expected + b.double().numpy()
    assert y.shape == (x.shape[0], data.shape[0]) and y.dtype == torch.float32
    error = np.abs(y.double().numpy() - expected)
    bound = 4e-6 * (size + np.abs(expected)) + 1e-30
    assert (error <= bound).all(), f"{what}: worst error {error.max()} against bound {bound.flat[error.argmax()]}"


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=NAMES.get)
def test_int8_product_equals_float64_of_llama_cpp_rounded_x_for_1_to_13_and_70_rows(qtype):
    """Decode rows (1-12), one more, and a prefill-sized batch past one pass of 64 rows; odd block counts (the VNNI
    kernels pair legacy blocks), a bias, x with a large mean (offsets and mins meet x's sums)."""
    ks = (768, 256) if gguf_quants.TYPES[qtype].values_per_block == 256 else (160, 96)
    for k in ks:
        for m in (*range(1, 14), 70):
            _check(qtype, m, k, seed=m + k, what=f"{NAMES[qtype]} k={k}, {m} rows", bias=m == 3)


@pytest.mark.parametrize("build", ["portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni", "amx_int8"])
def test_each_c_build_equals_the_rounded_reference(build, tmp_path, monkeypatch):
    """AVX2 runs the vpmaddubsw kernels (gguf_q8_avx2.h), AVX2 with AVX-VNNI their 256-bit vpdpbusd form (AVX-512
    without VNNI AVX2's), AVX-512 VNNI the 512-bit kernels; odd block counts (a legacy row's last block alone, a
    K-quant row's odd block), several rows of x, and a prefill-sized batch past one pass of 64 rows. Every build but
    the portable one also reads the tile layout (AVX2's int16 sums, AVX-512 VNNI's kernels, AMX's tiles from 17
    rows); portable layers keep their blocks."""
    with forced_build(build, tmp_path, monkeypatch):
        for qtype in INT8_TYPES:
            ks = (512, 768) if gguf_quants.TYPES[qtype].values_per_block == 256 else (160, 96)
            tiled = build != "portable"  # every int8 type has the layout there
            assert (_tiles(gp.random_blocks(qtype, 3, ks[0]), qtype, ks[0]) is not None) == tiled
            for product in (_product, _tiled_product) if tiled else (_product,):
                for k in ks:
                    for m in (1, 5, 12, 70) if k == ks[0] else (2,):
                        _check(qtype, m, k, seed=qtype + m + k, product=product,
                               what=f"{build}, {NAMES[qtype]}, k={k}, {m} rows, {product.__name__}")
                _check_extremes(qtype, ks[0], build, product)


_Q6_K_SCALES = slice(192, 208)  # a Q6_K block's 16 int8 sub-block scales, after its 128 + 64 bytes of values


def _extreme_blocks(qtype: int, k: int, fill: int, q6_k_scales: int | None = None) -> np.ndarray:
    """Rows whose every byte but the fp16 fields is `fill`: 0xff puts the 4/5/6-bit values at their largest (15 / 31 /
    63) and Q8_0's at -1, 0x80 Q8_0's at -128; Q6_K's scales then `q6_k_scales` where given (0x00 values: q = 0,
    its signed -32, the least)."""
    data = gp.random_blocks(qtype, 3, k)
    blocks = data.reshape(3, k // gguf_quants.TYPES[qtype].values_per_block, -1)
    kept = blocks.copy()
    blocks[...] = fill
    for offset in gp._HALVES[qtype]:
        blocks[..., offset:offset + 2] = kept[..., offset:offset + 2]
    if q6_k_scales is not None:
        blocks[..., _Q6_K_SCALES] = q6_k_scales
    return data


def _check_extremes(qtype: int, k: int, build: str, product=_product) -> None:
    """The largest weights (and Q6_K's least) times x's q at -127 and 127 (x constant per block, alternating in sign,
    or 127 throughout a K-quant block but its first value; 12 rows, past AVX2's widened passes from 8): pairs of
    products up to 2 * 128 * 127, where vpmaddubsw's int16 sums would saturate or wrap but for the operands'
    ranges."""
    rows = torch.tensor([[1.0] * k, [-1.0] * k, [(-1.0) ** i for i in range(k)],
                         [-1.0 if i % 256 == 0 else 1.0 for i in range(k)]]).repeat(3, 1)
    cases = [(0xFF, None), (0x80, None)] + ([(0x00, 0x7F), (0x00, 0x80)] if qtype == gp.Q6_K else [])
    for fill, scales in cases:
        _compare(rows, _extreme_blocks(qtype, k, fill, scales), qtype,
                 f"{build}, {NAMES[qtype]}, bytes {fill:#x}, Q6_K scales {scales}", product=product)


def _one_hot_q8_0(columns: list[int], k: int) -> np.ndarray:
    """Q8_0 rows, d = 1, q = 1 at one column each: a row reads x's rounded value there back."""
    blocks = np.zeros((len(columns), k // 32, 34), dtype=np.uint8)
    blocks[..., 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    for row, column in enumerate(columns):
        blocks[row, column // 32, 2 + column % 32] = 1
    return blocks.reshape(len(columns), -1)


def test_ties_round_as_llama_cpp_rounds_them():
    """Q8_0 blocks round x * (1 / d) with roundf (2.5 -> 3, -4.5 -> -5), Q8_K blocks with nearest_int, ties to even
    (2.5 -> 2, -4.5 -> -4): with d = 1 (a block whose largest magnitude is 127) a one-hot weight reads them back."""
    x = np.zeros((1, 256), dtype=np.float32)
    x[0, 0], x[0, 1], x[0, 2] = -127.0, 2.5, -4.5  # Q8_K: iscale = -127 / -127 = 1; Q8_0's first block: d = 1
    y = _product(torch.from_numpy(x), _one_hot_q8_0([1, 2], 256), gp.Q8_0)
    np.testing.assert_array_equal(y.numpy(), [[3.0, -5.0]])
    q = np.full((2, 256), 32)
    q[0, 1], q[1, 2] = 33, 33  # Q6_K's value q - 32: 1 at x[1] (row 0) and at x[2] (row 1)
    k_quant = gp.pack_q6_k(np.ones(2), np.ones((2, 16), dtype=np.int64), q)
    np.testing.assert_array_equal(_product(torch.from_numpy(x), k_quant, gp.Q6_K).numpy(), [[2.0, -4.0]])


def test_zero_rows_of_x_give_zero_and_bias():
    data = gp.random_blocks(gp.Q4_K, 5, 256)
    bias = torch.arange(5, dtype=torch.float32)
    y = _product(torch.zeros(2, 256), data, gp.Q4_K, bias)
    np.testing.assert_array_equal(y.numpy(), np.tile(bias.numpy(), (2, 1)))


@pytest.mark.parametrize("qtype", (gp.F32, gp.F16))
def test_types_without_int8_kernels_are_refused_naming_those_with(qtype):
    with pytest.raises(ConfigError, match="has no kernel for GGUF type .*Q4_0.*Q6_K"):
        gguf_quants.kernel_kind(qtype, "int8")


def test_int8_without_the_c_kernels_is_refused_not_run_in_float(monkeypatch):
    from strata.kernels.cpu import matmul as cpu_matmul
    monkeypatch.setattr(cpu_matmul, "available", lambda: False)
    with pytest.raises(ConfigError, match="C kernels only"):
        _product(torch.ones(1, 32), gp.random_blocks(gp.Q8_0, 2, 32), gp.Q8_0)


def test_avx512_vnni_gives_each_row_the_same_bits_alone_or_among_up_to_7_rows(tmp_path, monkeypatch):
    """A decode row and a verification step's rows (2-7 of them through the GGUF blocks' kernels; any number from
    the tile layout) take one arithmetic: each row's product is the same float32, bit for bit, whatever rows share
    the pass (a greedy verification then sees the logits decoding would). One build for every kind."""
    with forced_build("avx512_vnni", tmp_path, monkeypatch):
        for qtype in (gp.Q4_1, gp.Q5_0, gp.Q8_0, gp.Q4_K, gp.Q6_K):
            k = 512 if gguf_quants.TYPES[qtype].values_per_block == 256 else 160
            data = gp.random_blocks(qtype, 19, k, 7)
            x = torch.randn(7, k, generator=torch.Generator().manual_seed(3))
            alone = torch.cat([_product(x[i:i + 1], data, qtype) for i in range(7)])
            for m in (2, 3, 4, 5, 7):
                assert torch.equal(_product(x[:m], data, qtype), alone[:m]), f"{NAMES[qtype]}, {m} rows"
            x = torch.randn(12, k, generator=torch.Generator().manual_seed(3))  # the tile layout: any rows (no AMX)
            alone = torch.cat([_tiled_product(x[i:i + 1], data, qtype) for i in range(12)])
            for m in (3, 8, 9, 12):
                assert torch.equal(_tiled_product(x[:m], data, qtype), alone[:m]), f"{NAMES[qtype]} tiled, {m} rows"


def test_a_nan_in_x_is_read_without_reading_past_its_block():
    """Q8_K's scale comes from the first value of largest magnitude; a NaN among the values (or all of them) must not
    send that search past the block."""
    data = gp.random_blocks(gp.Q4_K, 3, 512)
    x = torch.randn(2, 512)
    x[0, 7] = float("nan")
    x[1, :256] = float("nan")
    y = _product(x, data, gp.Q4_K)
    assert y.shape == (2, 3)


needs_tiles = pytest.mark.skipif(_tiles(gp.random_blocks(gp.Q4_0, 1, 32), gp.Q4_0, 32) is None,
                                 reason="this build has no tile layout (it needs AVX2)")


@needs_tiles
@pytest.mark.parametrize("qtype", INT8_TYPES, ids=NAMES.get)
def test_tiled_weights_equal_float64_of_llama_cpp_rounded_x_for_1_to_20_and_70_rows(qtype):
    """The layout loaded layers hold on AVX-512 VNNI builds: 21 outputs (a last strip of 5), odd group or block counts,
    rows through the VNNI kernels' passes of 8, 4, 2, 1 and, from 17 rows where the CPU has them, AMX's tiles (70 rows:
    five tiles of rows, the last of 6); a bias; x with a large mean (the weights' zero, m and mins meet x's sums)."""
    for k in (768, 256) if gguf_quants.TYPES[qtype].values_per_block == 256 else (160, 96):
        for m in (*range(1, 21), 70):
            _check(qtype, m, k, seed=m + k, what=f"{NAMES[qtype]} tiled, k={k}, {m} rows", bias=m in (3, 17),
                   product=_tiled_product)


@needs_tiles
def test_tiled_rows_have_the_same_bits_alone_or_among_any_rows():
    """A decode row and a verification step's rows, on the VNNI kernels or (from 17 rows) the tiles, take one
    arithmetic: each row's product is the same float32, bit for bit, whatever rows share it."""
    for qtype in INT8_TYPES:
        k = 512 if gguf_quants.TYPES[qtype].values_per_block == 256 else 160
        data = gp.random_blocks(qtype, 37, k, 5)
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(4))
        alone = torch.cat([_tiled_product(x[i:i + 1], data, qtype) for i in range(20)])
        for m in (2, 5, 8, 9, 16, 20):
            assert torch.equal(_tiled_product(x[:m], data, qtype), alone[:m]), f"{NAMES[qtype]}, {m} rows"


@pytest.mark.parametrize("build", ["avx2", "avx2_vnni", "avx512"])
def test_avx2_tiled_rows_have_the_same_bits_alone_or_among_any_rows_as_the_vnni_kernels(build, tmp_path, monkeypatch):
    """AVX2's kernels on the layout (int16 sums over several rows of a group, or AVX-VNNI's int32 ones; half a strip
    a register; a strip's values made bytes once from 8 rows) make the VNNI kernels' integers and take their float
    steps lane by lane: each row's product is the same float32 alone or among any rows (up to 20: passes of 2 and
    1, a last strip of 5 outputs), and, where this CPU has AVX-512 VNNI, that build's."""
    cases = []
    for qtype in INT8_TYPES:
        k = 512 if gguf_quants.TYPES[qtype].values_per_block == 256 else 160
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(4))
        cases.append((qtype, gp.random_blocks(qtype, 37, k, 5), x))
    alone = {}
    with forced_build(build, tmp_path, monkeypatch):
        for qtype, data, x in cases:
            alone[qtype] = torch.cat([_tiled_product(x[i:i + 1], data, qtype) for i in range(20)])
            for m in (2, 3, 5, 8, 9, 20):
                assert torch.equal(_tiled_product(x[:m], data, qtype), alone[qtype][:m]), f"{NAMES[qtype]}, {m} rows"
    if "avx512_vnni" not in cpu_flags():
        return
    with forced_build("avx512_vnni", tmp_path, monkeypatch):
        for qtype, data, x in cases:
            for m in (1, 7, 20):
                assert torch.equal(_tiled_product(x[:m], data, qtype), alone[qtype][:m]), f"{NAMES[qtype]}, {m} rows"


@needs_tiles
def test_tiling_a_weight_of_another_kind_or_shape_is_refused():
    assert _tiles(gp.random_blocks(gp.F16, 3, 64), gp.F16, 64) is None
    tiles = _tiles(gp.random_blocks(gp.Q4_0, 3, 64), gp.Q4_0, 64)
    with pytest.raises(ValueError, match="do not read weight kind"):  # strips of 64 values read as rows of 32
        gguf_quants.tiled_linear(torch.ones(1, 32), tiles, gp.Q4_0, 32, 3)

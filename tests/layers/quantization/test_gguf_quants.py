"""GGUF tensor types: the torch dequantizer, the C kernels (small batch, fixed point, GEMM, portable) and the
embedding lookup against gguf-py's dequantize, hand-checked blocks, and refusals."""
from __future__ import annotations

import gguf_packing as gp  # noqa: E402
import numpy as np
import pytest
import torch
from c_builds import forced_build, gemm_engine
from gguf_packing import ALL_TYPES, Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0  # noqa: E402

from strata.errors import ConfigError
from strata.kernels.cpu import abi, crossovers
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.quantization import gguf_quants

QUANTIZED = (gp.Q4_0, gp.Q4_1, Q5_0, gp.Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
NAMES = {t: gguf_quants.TYPES[t].name for t in ALL_TYPES}


def _rows(qtype: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Random valid rows of `qtype` (quantized from random floats by gguf-py where it can, else random blocks) and
    gguf-py's dequantize of them."""
    data = gp.random_blocks(qtype, n, k, seed)
    return torch.from_numpy(data), gp.reference(data, qtype)


def _block_values(qtype: int) -> int:
    return gguf_quants.TYPES[qtype].values_per_block


def _assert_close_to(y: torch.Tensor, expected: np.ndarray, what: str) -> None:
    """Within 1e-5 of the outputs' scale: float32 accumulation (and the kernels' 24-bit x) is that exact."""
    expected = torch.from_numpy(expected)
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=tolerance, msg=lambda e: f"{what}: {e}")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=NAMES.get)
def test_dequantize_equals_gguf_on_random_and_quantized_rows(qtype):
    k = 768 if _block_values(qtype) == 256 else 96
    quantized = gp.quantize(np.random.default_rng(1).standard_normal((7, k)).astype(np.float32), qtype)
    for data in (gp.random_blocks(qtype, 7, k), quantized):
        y = gguf_quants.dequantize(torch.from_numpy(data), qtype, k)
        assert y.dtype == torch.float32 and y.shape == (7, k)
        np.testing.assert_array_equal(y.numpy(), gp.reference(data, qtype))


def _hand_q4_k_block() -> tuple[np.ndarray, np.ndarray]:
    """One Q4_K block and its values computed from the spec: scales and mins above 15 in sub-blocks 4-7, whose top
    2 bits live in bytes 0-7 (the j >= 4 case)."""
    d, dmin = np.float32(0.5), np.float32(0.25)
    sc = np.array([1, 2, 63, 17, 48, 33, 5, 60])
    mn = np.array([0, 7, 63, 31, 62, 16, 1, 47])
    q = (np.arange(256) * 7 % 16).reshape(8, 32)
    values = d * sc[:, None] * q - dmin * mn[:, None]
    return gp.pack_q4_k(np.array([d]), np.array([dmin]), sc[None], mn[None], q[None]), values.reshape(1, 256)


def _hand_q5_k_block() -> tuple[np.ndarray, np.ndarray]:
    d, dmin = np.float32(0.125), np.float32(2.0)
    sc = np.array([40, 3, 9, 63, 16, 31, 58, 2])
    mn = np.array([5, 60, 0, 12, 63, 44, 19, 50])
    q = (np.arange(256) * 11 % 32).reshape(8, 32)
    values = d * sc[:, None] * q - dmin * mn[:, None]
    return gp.pack_q5_k(np.array([d]), np.array([dmin]), sc[None], mn[None], q[None]), values.reshape(1, 256)


def _hand_q6_k_block() -> tuple[np.ndarray, np.ndarray]:
    d = np.float32(0.0625)
    sc = np.array([1, -1, 127, -128, 64, 3, -7, 100, 0, 55, -90, 12, 8, -33, 77, 21])
    q = np.arange(256) * 5 % 64
    values = d * sc.repeat(16) * (q - 32)
    return gp.pack_q6_k(np.array([d]), sc[None], q[None]), values.reshape(1, 256)


def _hand_q5_0_block() -> tuple[np.ndarray, np.ndarray]:
    """Q5_0: the fifth bit of value j is bit j of qh; value j < 16 in the low nibble of qs[j], j >= 16 in the high
    nibble of qs[j - 16]."""
    q = np.arange(32) * 13 % 32
    qh = sum(int(q[j] >> 4) << j for j in range(32))
    qs = (q[:16] & 15) | ((q[16:] & 15) << 4)
    block = np.concatenate([gp._halves(np.array([0.5])).reshape(2), np.array([qh], "<u4").view(np.uint8),
                            qs.astype(np.uint8)])
    return block[None], (0.5 * (q - 16)).reshape(1, 32)


@pytest.mark.parametrize("qtype,make", [(Q4_K, _hand_q4_k_block), (Q5_K, _hand_q5_k_block), (Q6_K, _hand_q6_k_block),
                                        (Q5_0, _hand_q5_0_block)], ids=["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_hand_packed_blocks_give_their_values(qtype, make):
    block, values = make()
    np.testing.assert_array_equal(gp.reference(block, qtype), values)  # the packing agrees with gguf-py's layout
    k = values.shape[1]
    data = torch.from_numpy(np.repeat(block, 3, axis=0))
    np.testing.assert_array_equal(gguf_quants.dequantize(data, qtype, k).numpy(), np.repeat(values, 3, axis=0))
    np.testing.assert_array_equal(gguf_quants.embedding_rows(data, qtype, k, torch.tensor([2])).numpy(), values)
    # one-hot rows of x pick single values out of the products (fixed-point, float and GEMM kernels)
    for m in (1, 3, 5, 17):
        columns = torch.arange(m) * 7 % k
        x = torch.nn.functional.one_hot(columns, k).float()
        y = gguf_quants.gguf_linear(x, data, qtype, k)
        _assert_close_to(y, np.repeat(values[:, columns.numpy()].T, 3, axis=1), f"{m} one-hot rows")


def _linear_on_threads(threads: int, *args) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return gguf_quants.gguf_linear(*args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=NAMES.get)
def test_gguf_linear_matches_x_times_gguf_dequantized_for_1_to_20_rows(qtype, threads):
    """Every path: fixed point (1-3 rows), float small batch (both ends of SMALL_BATCH), GEMM (beyond it). Odd
    numbers of blocks (the fixed-point kernels pair them), odd N, a bias, and x with a large mean (the offsets of
    Q4_0 / Q5_0 / Q6_K and the mins meet x summed)."""
    ks = (768, 256) if _block_values(qtype) == 256 else (160, 96)
    for k in ks:
        data, weight = _rows(qtype, 37, k, seed=k)
        bias = torch.randn(37, generator=torch.Generator().manual_seed(k))
        for m in range(1, 21):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) + (3.0 if m % 2 else 0.0)
            y = _linear_on_threads(threads, x, data, qtype, k, bias)
            assert y.shape == (m, 37) and y.dtype == torch.float32
            _assert_close_to(y, x.double().numpy() @ weight.T + bias.double().numpy(), f"k={k}, {m} rows")


@pytest.mark.parametrize("qtype", (Q4_0, Q8_0, Q4_K, Q6_K), ids=NAMES.get)
def test_a_shard_of_whole_blocks_of_each_row_multiplies_in_place(qtype):
    """A row-parallel shard: columns of whole blocks, a view with the full rows' stride."""
    per_block, nbytes = gp.SIZES[qtype]
    data, weight = _rows(qtype, 10, 4 * per_block, seed=9)
    shard = data[:, nbytes:3 * nbytes]
    for m in (1, 5, crossovers.SMALL_BATCH_GGUF + 1):
        x = torch.randn(m, 2 * per_block)
        y = gguf_quants.gguf_linear(x, shard, qtype, 2 * per_block)
        _assert_close_to(y, x.double().numpy() @ weight[:, per_block:3 * per_block].T, f"{m} rows")
    np.testing.assert_array_equal(gguf_quants.embedding_rows(shard, qtype, 2 * per_block, torch.tensor([9])).numpy(),
                                  weight[[9], per_block:3 * per_block])


@pytest.mark.parametrize("engine", ["FMA", "AMX"])
@pytest.mark.parametrize("qtype", QUANTIZED, ids=NAMES.get)
def test_small_batch_kernel_and_gemm_each_match_at_every_row_count_they_may_serve(qtype, engine):
    """Both GEMM engines (AMX: 16-row blocks in pairs, an odd one, outputs in a partial second strip of a pair; Q6_K
    on AMX in halves of 16 values), over K in one panel and (K of 1536 or 2048) in two."""
    kind = gguf_quants.kernel_kind(qtype)
    with gemm_engine(engine):
        for k in (512 if _block_values(qtype) == 256 else 224, 2048 if _block_values(qtype) == 256 else 1536):
            data, weight = _rows(qtype, 21, k, seed=5)
            for m in (1, 2, 3, 4, 6, crossovers.SMALL_BATCH_GGUF, crossovers.SMALL_BATCH_GGUF + 1, 48):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                expected = x.double().numpy() @ weight.T
                _assert_close_to(cpu_matmul.matmul(x, data, kind, 21), expected, f"small batch, {m} rows")
                _assert_close_to(cpu_matmul.narrow_gemm(x, data, kind, 21), expected, f"GEMM, {m} rows")


def test_amx_gemm_runs_for_every_quantized_type_in_its_own_order_and_matches():
    """Each quantized type the AMX GEMM reads (Q6_K: each half of a run of 32 a tile product under its own scale)
    gives bits of its own there, not the FMA GEMM's, and both stay within float32's error of gguf-py."""
    for qtype in QUANTIZED:
        k = 512 if _block_values(qtype) == 256 else 224
        data, weight = _rows(qtype, 40, k, seed=7)
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
        products = {}
        for engine in ("FMA", "AMX"):
            with gemm_engine(engine):
                products[engine] = cpu_matmul.narrow_gemm(x, data, gguf_quants.kernel_kind(qtype), 40)
            _assert_close_to(products[engine], x.double().numpy() @ weight.T, f"{NAMES[qtype]} on {engine}")
        assert not torch.equal(products["FMA"], products["AMX"]), f"{NAMES[qtype]}: AMX gave the FMA GEMM's bits"


@pytest.mark.parametrize("qtype", (Q4_0, Q4_K, Q6_K), ids=NAMES.get)
def test_fixed_point_product_keeps_tiny_huge_and_outlier_activations_exact(qtype):
    k = 512
    data, weight = _rows(qtype, 16, k, seed=2)
    for magnitude in (1e-30, 1.0, 1e25):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(0)) * magnitude
        x[0, ::97] *= 50  # outlier channels
        x[0, :128] *= 1e-3  # one 128-value block of x far below the others
        _assert_close_to(gguf_quants.gguf_linear(x, data, qtype, k), x.double().numpy() @ weight.T, f"{magnitude}")


def test_fixed_point_product_passes_nan_and_infinity_through():
    data, _ = _rows(Q4_K, 8, 256)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 256)
        x[0, 100] = bad
        assert not torch.isfinite(gguf_quants.gguf_linear(x, data, Q4_K, 256)).any()


def test_bfloat16_input_gives_bfloat16_output():
    data, weight = _rows(Q8_0, 12, 64)
    x = torch.randn(3, 2, 64).bfloat16()
    y = gguf_quants.gguf_linear(x, data, Q8_0, 64)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 2, 12)
    expected = x.double().reshape(6, 64).numpy() @ weight.T
    torch.testing.assert_close(y.double().reshape(6, 12), torch.from_numpy(expected), rtol=1e-2, atol=2e-2)


def test_without_the_c_kernels_torch_dequantizes_and_multiplies(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "available", lambda: False)
    data, weight = _rows(Q6_K, 9, 256)
    x = torch.randn(2, 256)
    _assert_close_to(gguf_quants.gguf_linear(x, data, Q6_K, 256, torch.ones(9)), x.double().numpy() @ weight.T + 1,
                     "torch path")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=NAMES.get)
def test_embedding_rows_are_the_dequantized_rows_of_repeated_and_edge_ids(qtype, monkeypatch):
    k = 256 if _block_values(qtype) == 256 else 96
    data, table = _rows(qtype, 11, k, seed=3)
    ids = torch.tensor([[0, 10, 5], [5, 0, 10]])
    for c_kernels in (True, False):
        monkeypatch.setattr(cpu_matmul, "available", lambda c=c_kernels: c)
        rows = gguf_quants.embedding_rows(data, qtype, k, ids)
        assert rows.shape == (2, 3, k) and rows.dtype == torch.float32
        np.testing.assert_array_equal(rows.numpy(), table[ids.numpy()])
        assert gguf_quants.embedding_rows(data, qtype, k, torch.tensor([], dtype=torch.int64)).shape == (0, k)
    with pytest.raises(IndexError, match="0..10"):
        gguf_quants.embedding_rows(data, qtype, k, torch.tensor([11]))


@pytest.mark.parametrize("qtype,name", [(10, "Q2_K"), (11, "Q3_K"), (15, "Q8_K"), (23, "IQ4_XS"), (34, "TQ1_0"),
                                        (77, "unknown type 77")])
def test_unsupported_types_are_refused_naming_tensor_and_type(qtype, name):
    with pytest.raises(ConfigError, match=rf"'blk\.0\.ffn_down\.weight' has type {name} \({qtype}\)"):
        gguf_quants.check_type(qtype, "blk.0.ffn_down.weight")
    with pytest.raises(ConfigError, match=name):
        gguf_quants.dequantize(torch.zeros(2, 64, dtype=torch.uint8), qtype, 64)


def test_rows_of_partial_blocks_are_refused_by_python_and_by_the_kernels():
    with pytest.raises(ConfigError, match="whole blocks of 256 values, not 320"):
        gguf_quants.gguf_linear(torch.randn(1, 320), torch.zeros(4, 180, dtype=torch.uint8), Q4_K, 320)
    with pytest.raises(ConfigError, match=r"uint8 \[N, 18\]"):
        gguf_quants.dequantize(torch.zeros(4, 20, dtype=torch.uint8), Q4_0, 32)
    for product in (cpu_matmul.matmul, cpu_matmul.narrow_gemm):
        with pytest.raises(ValueError, match="whole blocks"):
            product(torch.randn(1, 48), torch.zeros(4, 36, dtype=torch.uint8), gguf_quants.kernel_kind(Q4_0), 4)
        with pytest.raises(ValueError, match="whole blocks"):  # Q3_K: a kind the kernels do not read
            product(torch.randn(1, 256), torch.zeros(4, 110, dtype=torch.uint8), abi.KIND_GGUF + 11, 4)


# The plain-C build, AVX2 without F16C (its halves converted in C) and AMX tiles (its GEMM on them), beside the
# native build the other tests use.
@pytest.mark.parametrize("build", ["portable", "avx2", "amx"])
def test_each_c_build_matches_gguf(build, tmp_path, monkeypatch):
    with forced_build(build, tmp_path, monkeypatch), gemm_engine("AMX" if build == "amx" else "FMA"):
        for qtype in ALL_TYPES:
            k = 512 if _block_values(qtype) == 256 else 160
            data, weight = _rows(qtype, 19, k, seed=qtype)
            for m, threads in ((1, 1), (3, 2), (6, 2), (crossovers.SMALL_BATCH_GGUF + 3, 2)):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) + 1
                y = _linear_on_threads(threads, x, data, qtype, k)
                _assert_close_to(y, x.double().numpy() @ weight.T, f"{build}, {NAMES[qtype]}, {m} rows")
            ids = torch.tensor([18, 0, 18])
            np.testing.assert_array_equal(gguf_quants.embedding_rows(data, qtype, k, ids).numpy(), weight[[18, 0, 18]])

"""The fused decode path's own arithmetic in csrc/decode_layer.c: each row's argmax over its logits."""
import numpy as np
import pytest
import torch

from strata.kernels.cpu import decode_layer


def reference_argmax(row: np.ndarray) -> int:
    """torch's and numpy's rule: the first NaN if there is one, else the first index of the largest value."""
    nans = np.flatnonzero(np.isnan(row))
    return int(nans[0]) if len(nans) else int(np.flatnonzero(row == row.max())[0])


def rows_with_every_case(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((9, n)).astype(np.float32)
    rows[1] = np.round(rows[1])  # many ties: the first of them
    rows[2, -1] = 50.0  # the largest last, past the vector loops
    rows[3, 0] = 50.0
    rows[3, n // 2] = 50.0  # a tie with the first value
    rows[4] = -np.inf  # every value -inf: index 0
    rows[5, n // 3] = np.nan  # a NaN anywhere counts as the largest
    rows[5, n - 1] = 1e30
    rows[6] = 0.0
    rows[6, n // 2:] = -0.0  # -0 and +0 are equal: the first
    rows[6, 0] = -0.0
    rows[7, n - 1] = np.nan  # a NaN in the tail only
    rows[8] = rng.integers(-3, 3, n).astype(np.float32)
    return rows


def first_argmax(rows: np.ndarray) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.zeros(rows.shape[0], dtype=np.int64)
    decode_layer.library().first_argmax(rows.ctypes.data, rows.shape[0], rows.shape[1], out.ctypes.data)
    return out


@pytest.fixture(params=["native", "x86-64-v3"])
def decode_build(request, x86_64_v3):
    """The library as this machine builds it, then built for x86-64-v3 (AVX2, no AVX-512)."""
    if request.param == "x86-64-v3":
        x86_64_v3(decode_layer.library)
    if decode_layer.library() is None:
        pytest.skip("no C compiler here")


@pytest.mark.parametrize("n", [1, 5, 16, 63, 64, 65, 100, 1000, 49152])
def test_each_rows_argmax_is_its_first_largest_value_or_its_first_nan(decode_build, n):
    rows = rows_with_every_case(n, seed=n)
    got = first_argmax(rows)
    assert got.tolist() == [reference_argmax(row) for row in rows]
    finite = ~np.isnan(rows).any(axis=1)
    assert (got[finite] == torch.from_numpy(rows[finite]).argmax(dim=1).numpy()).all()

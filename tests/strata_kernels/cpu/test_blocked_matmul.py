"""The blocked small-batch kernel (`strata/kernels/cpu/csrc/blocked_matmul.c`) on layouts built by hand: every block
width it reads, float32 and bfloat16 weights, padded K, 1-7 rows of x (its passes of one to four rows), 1 and 2
threads, as built here and in plain C."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import build
from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.abi import I32, I64, PTR


def _blocked(weight: torch.Tensor, block: int, k_pad: int) -> torch.Tensor:
    """weight [n, k] as the kernel reads it: outputs in blocks, each k_pad rows of `block` outputs (bfloat16:
    values k and k + 1 of an output side by side), zeros in the padding."""
    n, k = weight.shape
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, k_pad, dtype=weight.dtype)
    padded[:n, :k] = weight
    by_block = padded.view(blocks, block, k_pad)
    if weight.dtype == torch.float32:
        return by_block.transpose(1, 2).contiguous()  # [blocks, k_pad, block]
    return by_block.view(blocks, block, k_pad // 2, 2).transpose(1, 2).contiguous()  # [blocks, k_pad / 2, block, 2]


@pytest.fixture(scope="module", params=["native", "portable"])
def library(request, tmp_path_factory):
    """The kernel as strata builds it here (AVX2 strips where the CPU has them), and in plain C."""
    if request.param == "native":
        lib = cpu_matmul.blocked_library()
        if lib is None:
            pytest.skip("no C compiler")
        return lib
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    target = tmp_path_factory.mktemp("portable") / "blocked_matmul.so"
    source = build.SOURCES / "blocked_matmul.c"
    subprocess.run([compiler, "-O2", "-fopenmp", "-shared", "-fPIC", "-DSTRATA_PORTABLE", str(source), "-o",
                    str(target)], check=True)
    lib = ctypes.CDLL(str(target))
    lib.blocked_matmul.argtypes = [PTR, I64, I64, PTR, I32, I64, I64, I64, PTR, PTR, I32, I32]
    lib.blocked_matmul.restype = I32
    return lib


@pytest.mark.parametrize("block", [8, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_blocked_kernel_matches_f_linear_for_every_block_width_and_row_count(library, block, dtype, threads):
    g = torch.Generator().manual_seed(block)
    n, k = 2 * block + 5, 203  # a partial last block; k neither a multiple of 2 nor of a block of rows
    k_pad = 208
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    bias = torch.randn(n, generator=g)
    buffer = _blocked(w, block, k_pad)
    for rows in range(1, 8):
        x = torch.randn(rows, k, generator=g)
        out = torch.full((rows, n), float("nan"))
        status = library.blocked_matmul(x.data_ptr(), rows, k, buffer.data_ptr(), int(dtype == torch.bfloat16),
                                        block, k_pad, n, bias.data_ptr(), out.data_ptr(), threads, 0)
        assert status == 0
        want = F.linear(x.double(), w.double(), bias.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=f"{rows} rows")


def test_an_unknown_block_width_is_refused(library):
    x, out, w = torch.randn(1, 8), torch.empty(1, 24), torch.zeros(24 * 8)
    assert library.blocked_matmul(x.data_ptr(), 1, 8, w.data_ptr(), 0, 24, 8, 24, None, out.data_ptr(), 1, 0) == -1

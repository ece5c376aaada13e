"""The blocked small-batch kernel (`strata/csrc/blocked_matmul.c`) on layouts built by hand: every block width it
reads, float32 and bfloat16 weights, padded K, 1-7 rows of x (its passes of one to four rows), 1 and 2 threads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.layers import onednn_weights


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


@pytest.mark.parametrize("block", [8, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_blocked_kernel_matches_f_linear_for_every_block_width_and_row_count(block, dtype, threads):
    library = onednn_weights._library()
    if library is None:
        pytest.skip("no C compiler")
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


def test_an_unknown_block_width_is_refused():
    library = onednn_weights._library()
    if library is None:
        pytest.skip("no C compiler")
    x, out, w = torch.randn(1, 8), torch.empty(1, 24), torch.zeros(24 * 8)
    assert library.blocked_matmul(x.data_ptr(), 1, 8, w.data_ptr(), 0, 24, 8, 24, None, out.data_ptr(), 1, 0) == -1

"""Rotary embedding: a decode step's q and k rotated in place by the C kernel equal the torch ops' copies."""
from __future__ import annotations

import pytest
import torch

from strata.layers import rotary
from strata.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_kernel_gives_the_torch_rotation_exactly(dtype):
    if rotary._library() is None:
        pytest.skip("no C compiler")
    rope = RotaryEmbedding(64, 10000.0)
    positions = torch.tensor([0, 3, 70, 5000])
    qkv = torch.randn(4, (16 + 8 + 8) * 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k = qkv[:, :1024].view(4, 16, 64), qkv[:, 1024:1536].view(4, 8, 64)
    cos, sin = rope._tables(positions, dtype)
    want_q, want_k = rope._rotate_half_split(q, cos, sin), rope._rotate_half_split(k, cos, sin)
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, inside the qkv output
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_prefill_sized_batches_and_interleaved_pairs_return_copies():
    positions = torch.arange(rotary.KERNEL_TOKENS + 1)
    q, k = torch.randn(len(positions), 4, 32), torch.randn(len(positions), 2, 32)
    for rope in (RotaryEmbedding(32, 500.0), RotaryEmbedding(32, 500.0, interleaved=True)):
        before = q.clone()
        got_q, _ = rope(positions, q, k)
        assert got_q.data_ptr() != q.data_ptr() and torch.equal(q, before)

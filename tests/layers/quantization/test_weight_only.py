"""The packed weight-only layout round-trips, and every kernel path matches dequantize-then-matmul."""
from __future__ import annotations

import pytest
import torch

from strata.layers.quantization import weight_only
from strata.layers.quantization.weight_only import dequantize, pack_weight, unpack, weight_only_linear


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

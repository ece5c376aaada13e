"""The mixer's decode paths (in place on consecutive slots, or gathered) against the kernels they stand in for,
its TP shard rule for units (heads, groups) fewer than the ranks, and a quantized in_proj sharded like its weight."""
from __future__ import annotations

import pytest
import torch

from strata.distributed import ParallelContext
from strata.layers.mamba.causal_conv1d import causal_conv1d_update
from strata.layers.mamba.mixer import MambaBatch, MambaState, allocate_states, shard_units
from strata.layers.mamba.state_update import selective_state_update

H, P, N, C, K, SLOTS = 4, 8, 6, 32, 4, 8


def batch_for(slots: list[int]) -> MambaBatch:
    n, first = len(slots), slots[0]
    span = (first, first + n) if slots == list(range(first, first + n)) else None
    return MambaBatch(n, torch.tensor(slots), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                      None, span)


@pytest.mark.parametrize(("slots", "consecutive"), [([2, 3, 4], True), ([5, 1, 3], False)])
@pytest.mark.parametrize("gate", [True, False])
def test_decode_step_matches_the_kernels(slots, consecutive, gate):
    gen = torch.Generator().manual_seed(0)
    layer = MambaState(C, K, H, P, N)
    allocate_states([layer], SLOTS, torch.float32, torch.float32, torch.device("cpu"))
    layer.conv_state.copy_(torch.randn(SLOTS, C, K - 1, generator=gen))
    layer.ssm_state.copy_(torch.randn(SLOTS, H, P, N, generator=gen))
    conv_ref, ssm_ref = layer.conv_state.clone(), layer.ssm_state.clone()
    b = len(slots)
    x_conv, w, bias = torch.randn(b, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    x, dt = torch.randn(b, H, P, generator=gen), torch.randn(b, H, generator=gen)
    A, D, dt_bias = -torch.rand(H, generator=gen) - 0.1, torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    B, Cm = torch.randn(b, 1, N, generator=gen), torch.randn(b, 1, N, generator=gen)
    z = torch.randn(b, H, P, generator=gen) if gate else None
    batch = batch_for(slots)
    assert (batch.decode_span is not None) == consecutive

    index = torch.tensor(slots)
    got_conv = layer.conv(x_conv, w, bias, batch)
    want_conv = causal_conv1d_update(x_conv, conv_ref, w, bias, "silu", index)
    got = layer.scan(x, dt, A, B, Cm, D, z, dt_bias, batch)
    want = selective_state_update(ssm_ref, x, dt, A, B, Cm, D, z, dt_bias, True, (0.0, float("inf")), index)
    assert torch.allclose(got_conv, want_conv, atol=1e-5)
    assert torch.allclose(layer.conv_state, conv_ref, atol=1e-6)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(layer.ssm_state, ssm_ref, atol=1e-5)


def test_units_split_across_ranks_or_held_whole_when_fewer_than_ranks():
    rows = torch.arange(8).repeat_interleave(3)  # 8 units of 3 rows
    parts = [shard_units(rows, 8, ParallelContext(tp_rank=r, tp_size=4)).unique().tolist() for r in range(4)]
    assert parts == [[0, 1], [2, 3], [4, 5], [6, 7]]
    two = torch.arange(2).repeat_interleave(3)  # 2 units over 4 ranks: rank r holds unit r // 2
    assert [shard_units(two, 2, ParallelContext(tp_rank=r, tp_size=4)).tolist() for r in range(4)] == [
        [0, 0, 0], [0, 0, 0], [1, 1, 1], [1, 1, 1]]
    with pytest.raises(ValueError, match="3 units"):
        shard_units(torch.arange(6), 3, ParallelContext(tp_rank=0, tp_size=2))


def _pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C / 8], lowest bits first (compressed-tensors' packing along the last dim)."""
    words = (values.view(values.shape[0], -1, 8).long() << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize(("pieces", "tp"), [
    ([(36, 4), (16, 1), (4, 4)], 1),  # pieces not on whole int32s of zero points: loaded as one at TP=1
    ([(32, 4), (16, 1), (16, 1), (16, 4)], 2),  # z, B and C replicated, dt: each rank's rows whole int32s
])
def test_quantized_in_proj_holds_the_rows_of_its_weight_shard(pieces, tp):
    from strata.config.quant_config import PACKED, LinearScheme
    from strata.layers.mamba.mixer import ShardedColumnLinear
    from strata.layers.quantization.linear_method import quantize_layer
    from strata.layers.quantization.weight_only import dequantize

    gen = torch.Generator().manual_seed(1)
    n, k = sum(size for size, _ in pieces), 64
    q, zeros = torch.randint(0, 16, (n, k), generator=gen), torch.randint(0, 16, (n, 2), generator=gen)
    scales = torch.rand(n, 2, generator=gen) + 0.5
    dense = (q - zeros.repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    stored = {"weight_packed": _pack_int4(q), "weight_scale": scales, "weight_zero_point": _pack_int4(zeros.t()).t(),
              "weight_shape": torch.tensor([n, k])}
    for rank in range(tp):
        pc = ParallelContext(tp_rank=rank, tp_size=tp)
        plain = ShardedColumnLinear(k, pieces, pc, torch.float32)
        plain.weight.weight_loader(plain.weight, dense)
        quantized = ShardedColumnLinear(k, pieces, pc, torch.float32)
        quantize_layer(quantized, LinearScheme(PACKED, 4, 32, False), "in_proj")
        for suffix, tensor in stored.items():
            param = getattr(quantized, suffix)
            param.weight_loader(param, tensor)
        quantized.quant.finish(quantized)
        torch.testing.assert_close(dequantize(quantized.quant.weight), plain.weight.data)

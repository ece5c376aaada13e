"""Chunked SSD scan vs an explicit per-token recurrence: chunk sizes, packing, groups, continuation."""
from __future__ import annotations

import math

import pytest
import torch

from strata.layers.mamba.ssd import _MAX_SPLIT_LOG_DECAY as MAX_SPLIT
from strata.layers.mamba.ssd import benchmark, ssd_chunk_scan_varlen

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def reference_softplus(u: torch.Tensor) -> torch.Tensor:
    return torch.where(u > 20.0, u, torch.log1p(torch.exp(u.clamp(max=20.0))))


def reference_scan(x, dt, A, B, C, init=None, D=None, z=None, dt_bias=None, dt_limit=(0.0, math.inf)):
    """One sequence, float64, one token and one head at a time: the recurrence of spec 3.6."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    state = torch.zeros(H, P, N, dtype=torch.float64) if init is None else init.double().clone()
    y = torch.zeros(T, H, P, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            g = h // (H // G)
            u = dt[t, h] + (dt_bias[h].double() if dt_bias is not None else 0.0)
            delta = reference_softplus(u).clamp(dt_limit[0], dt_limit[1])
            state[h] = torch.exp(delta * A[h]) * state[h] + delta * torch.outer(x[t, h], B[t, g])
            y[t, h] = state[h] @ C[t, g]
            if D is not None:
                y[t, h] += D[h].double() * x[t, h]
            if z is not None:
                y[t, h] *= torch.nn.functional.silu(z[t, h].double())
    return y, state


def random_inputs(T, H=4, P=3, N=5, G=1, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=gen, dtype=torch.float64).to(dtype)
    dt = (torch.randn(T, H, generator=gen, dtype=torch.float64) - 0.5).to(dtype)
    A = -torch.rand(H, generator=gen, dtype=torch.float64).mul(2.0).add(0.2).to(dtype)
    B = torch.randn(T, G, N, generator=gen, dtype=torch.float64).to(dtype)
    C = torch.randn(T, G, N, generator=gen, dtype=torch.float64).to(dtype)
    D = torch.randn(H, generator=gen, dtype=torch.float64).to(dtype)
    dt_bias = (0.3 * torch.randn(H, generator=gen, dtype=torch.float64)).to(dtype)
    init = torch.randn(H, P, N, generator=gen, dtype=torch.float64).to(dtype)
    return x, dt, A, B, C, D, dt_bias, init


def seq_bounds(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 8, 16])
@pytest.mark.parametrize("length", [1, 3, 7, 8, 9, 17, 64])
def test_chunked_scan_equals_recurrence(length, chunk_size, with_init, dtype):
    x, dt, A, B, C, D, dt_bias, init = random_inputs(length, dtype=dtype, seed=length)
    init = init if with_init else None
    y, final = ssd_chunk_scan_varlen(
        x, dt, A, B, C, chunk_size, seq_bounds([length]),
        initial_states=None if init is None else init[None], D=D, dt_bias=dt_bias,
    )
    y_ref, final_ref = reference_scan(x, dt, A, B, C, init=init, D=D, dt_bias=dt_bias)
    assert y.dtype == dtype and final.shape == (1, 4, 3, 5)
    torch.testing.assert_close(y.double(), y_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(final[0].double(), final_ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_b_and_c_map_head_h_to_group_h_div_heads_per_group(groups):
    x, dt, A, B, C, D, dt_bias, init = random_inputs(13, H=4, G=groups, dtype=torch.float64, seed=groups)
    y, final = ssd_chunk_scan_varlen(x, dt, A, B, C, 4, seq_bounds([13]), init[None], D=D, dt_bias=dt_bias)
    y_ref, final_ref = reference_scan(x, dt, A, B, C, init=init, D=D, dt_bias=dt_bias)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final[0], final_ref, atol=1e-10, rtol=1e-10)


STEEPNESS = {
    # Two packed sequences; one head has chunks of both kinds.
    "mixed": ([40, 23], [-0.05, -0.8, -16.0, -3000.0]),
    # One sequence of whole chunks (the packed input is used in place); no chunk can be split.
    "all steep": ([64], [-300.0, -800.0, -16.0, -3000.0]),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(STEEPNESS))
def test_fast_and_slow_decaying_heads_both_equal_the_recurrence(case, dtype):
    """Chunks whose total log-decay is small take the split-decay product, the others their exact decay
    matrix; batches mixing both, per head and per chunk, or with no split chunk at all, equal the
    recurrence."""
    lengths, decays = STEEPNESS[case]
    chunk = 16
    x, dt, _, B, C, D, dt_bias, _ = random_inputs(sum(lengths), H=4, G=2, dtype=dtype, seed=11)
    A = torch.tensor(decays, dtype=dtype)
    inits = torch.randn(len(lengths), 4, 3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    inits = inits.to(dtype)
    bounds = seq_bounds(lengths)
    # As in the models, x is a view into a wider projection, rows apart by more than H * P.
    projection = torch.cat([x.flatten(1), torch.randn(sum(lengths), 7, dtype=dtype)], dim=1)
    x_view = projection[:, : 4 * 3].view(sum(lengths), 4, 3)
    y, final = ssd_chunk_scan_varlen(x_view, dt, A, B, C, chunk, bounds, inits, D=D, dt_bias=dt_bias)
    totals = []
    for i in range(len(lengths)):
        part = slice(int(bounds[i]), int(bounds[i + 1]))
        delta = reference_softplus(dt[part].double() + dt_bias.double()) * -A.double()
        totals += [delta[lo : lo + chunk].sum(0) for lo in range(0, lengths[i], chunk)]
        y_ref, final_ref = reference_scan(x[part], dt[part], A, B[part], C[part], inits[i], D=D, dt_bias=dt_bias)
        torch.testing.assert_close(y[part].double(), y_ref, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(final[i].double(), final_ref, atol=TOL[dtype], rtol=TOL[dtype])
    totals = torch.stack(totals)
    if case == "mixed":
        assert (totals[:, 2] < MAX_SPLIT).any() and (totals[:, 2] > MAX_SPLIT).any()
    else:
        assert (totals > MAX_SPLIT).all()
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(final).all())


# Unequal chunk counts; equal counts with padding; equal counts of whole chunks (no padding at all).
@pytest.mark.parametrize("lengths", [[9, 1, 20], [16, 13, 9], [16, 16, 16]])
def test_packed_sequences_equal_separate_runs_without_leakage(lengths):
    x, dt, A, B, C, D, dt_bias, _ = random_inputs(sum(lengths), H=4, G=2, seed=3)
    inits = torch.randn(3, 4, 3, 5, generator=torch.Generator().manual_seed(9))
    bounds = seq_bounds(lengths)
    y, final = ssd_chunk_scan_varlen(x, dt, A, B, C, 8, bounds, inits, D=D, dt_bias=dt_bias)
    for i in range(3):
        part = slice(int(bounds[i]), int(bounds[i + 1]))
        args = (x[part], dt[part], A, B[part], C[part])
        y_alone, final_alone = ssd_chunk_scan_varlen(
            *args, 8, seq_bounds([lengths[i]]), inits[i : i + 1], D=D, dt_bias=dt_bias
        )
        y_ref, final_ref = reference_scan(*args, init=inits[i], D=D, dt_bias=dt_bias)
        torch.testing.assert_close(y[part], y_alone, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(final[i], final_alone[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(y[part].double(), y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i].double(), final_ref, atol=1e-5, rtol=1e-5)


def test_empty_sequence_in_batch_keeps_its_initial_state():
    x, dt, A, B, C, D, dt_bias, _ = random_inputs(7, dtype=torch.float64)
    inits = torch.randn(3, 4, 3, 5, dtype=torch.float64)
    y, final = ssd_chunk_scan_varlen(x, dt, A, B, C, 4, seq_bounds([3, 0, 4]), inits, D=D, dt_bias=dt_bias)
    torch.testing.assert_close(final[1], inits[1])
    y_ref, final_ref = reference_scan(x[3:], dt[3:], A, B[3:], C[3:], init=inits[2], D=D, dt_bias=dt_bias)
    torch.testing.assert_close(y[3:], y_ref)
    torch.testing.assert_close(final[2], final_ref)


@pytest.mark.parametrize("split", [1, 5, 8, 13])
def test_prefix_then_continuation_from_its_final_state_equals_whole(split):
    x, dt, A, B, C, D, dt_bias, init = random_inputs(21, G=2, seed=split)
    kwargs = dict(D=D, dt_bias=dt_bias)
    y_all, final_all = ssd_chunk_scan_varlen(x, dt, A, B, C, 8, seq_bounds([21]), init[None], **kwargs)
    head = slice(0, split)
    tail = slice(split, 21)
    y_head, mid = ssd_chunk_scan_varlen(
        x[head], dt[head], A, B[head], C[head], 8, seq_bounds([split]), init[None], **kwargs
    )
    y_tail, final = ssd_chunk_scan_varlen(
        x[tail], dt[tail], A, B[tail], C[tail], 8, seq_bounds([21 - split]), mid, **kwargs
    )
    torch.testing.assert_close(torch.cat([y_head, y_tail]), y_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_all, atol=1e-5, rtol=1e-5)


def test_gate_multiplies_silu_z_after_the_d_skip():
    x, dt, A, B, C, D, dt_bias, init = random_inputs(11, dtype=torch.float64)
    z = torch.randn(11, 4, 3, dtype=torch.float64)
    y, _ = ssd_chunk_scan_varlen(x, dt, A, B, C, 4, seq_bounds([11]), init[None], D=D, z=z, dt_bias=dt_bias)
    y_ref, _ = reference_scan(x, dt, A, B, C, init=init, D=D, z=z, dt_bias=dt_bias)
    torch.testing.assert_close(y, y_ref)


def test_dt_limit_clamps_delta_and_softplus_is_linear_above_20():
    x, dt, A, B, C, D, _, init = random_inputs(10, dtype=torch.float64)
    dt = dt * 15.0  # reaches both the clamp bounds and the softplus threshold
    dt[0, 0] = 25.0
    for limit in [(0.0, math.inf), (0.05, 0.8)]:
        y, final = ssd_chunk_scan_varlen(x, dt, A, B, C, 4, seq_bounds([10]), init[None], D=D, dt_limit=limit)
        y_ref, final_ref = reference_scan(x, dt, A, B, C, init=init, D=D, dt_limit=limit)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(final[0], final_ref)


def test_without_softplus_dt_is_used_as_given():
    x, dt, A, B, C, _, _, _ = random_inputs(6, dtype=torch.float64)
    delta = dt.abs()
    y, _ = ssd_chunk_scan_varlen(x, delta, A, B, C, 4, seq_bounds([6]), dt_softplus=False)
    # softplus is invertible: feeding log(expm1(delta)) through the softplus path must give the same scan
    y_ref, _ = reference_scan(x, torch.log(torch.expm1(delta)), A, B, C)
    torch.testing.assert_close(y, y_ref)


def test_bfloat16_inputs_give_bfloat16_outputs_and_float32_states():
    x, dt, A, B, C, D, dt_bias, _ = random_inputs(9, seed=5)
    y, final = ssd_chunk_scan_varlen(
        x.bfloat16(), dt.bfloat16(), A, B.bfloat16(), C.bfloat16(), 4, seq_bounds([9]), D=D, dt_bias=dt_bias
    )
    y_ref, final_ref = reference_scan(
        x.bfloat16(), dt.bfloat16(), A, B.bfloat16(), C.bfloat16(), D=D, dt_bias=dt_bias
    )
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(final[0].double(), final_ref, atol=1e-5, rtol=1e-5)


def test_benchmark_reports_positive_timings():
    chunked, sequential = benchmark(num_tokens=32, heads=2, head_dim=4, dstate=4, chunk_size=8, repeats=1)
    assert chunked > 0.0 and sequential > 0.0


def test_caller_tensors_are_left_untouched():
    x, dt, A, B, C, D, _, init = random_inputs(16, dtype=torch.float32)
    dt = dt.abs()
    originals = [t.clone() for t in (x, dt, B, C, init)]
    ssd_chunk_scan_varlen(x, dt, A, B, C, 8, seq_bounds([16]), init[None], D=D, dt_softplus=False)
    for before, after in zip(originals, (x, dt, B, C, init), strict=True):
        torch.testing.assert_close(after, before, atol=0.0, rtol=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scan_matches_cpu_scan():
    lengths = [37, 5, 70]
    x, dt, A, B, C, D, dt_bias, _ = random_inputs(sum(lengths), H=8, P=16, N=8, G=2, seed=4)
    inits = torch.randn(3, 8, 16, 8)
    z = torch.randn_like(x)
    args = (x, dt, A, B, C, 16, seq_bounds(lengths), inits)
    kwargs = dict(D=D, z=z, dt_bias=dt_bias)
    y_cpu, final_cpu = ssd_chunk_scan_varlen(*args, **kwargs)
    to_cuda = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t
    cuda_kwargs = {k: to_cuda(v) for k, v in kwargs.items()}
    y_gpu, final_gpu = ssd_chunk_scan_varlen(*map(to_cuda, args), **cuda_kwargs)
    assert y_gpu.is_cuda and final_gpu.is_cuda
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final_gpu.cpu(), final_cpu, atol=1e-4, rtol=1e-4)


def test_batch_without_tokens_returns_the_initial_states():
    inits = torch.randn(2, 4, 3, 5)
    empty = random_inputs(0)
    y, final = ssd_chunk_scan_varlen(*empty[:5], 8, seq_bounds([0, 0]), inits)
    assert y.shape == (0, 4, 3)
    torch.testing.assert_close(final, inits)

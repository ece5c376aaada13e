"""Single-token SSM state update: one recurrence step in place; a decode loop equals the chunked scan."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from strata.layers.mamba.ssd import ssd_chunk_scan_varlen
from strata.layers.mamba.state_update import selective_state_update


def reference_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_limit=(0.0, math.inf)):
    """float64, explicit loops over sequences and heads; returns (new state, y)."""
    batch, H, P = x.shape
    G = B.shape[1]
    new = state.double().clone()
    y = torch.zeros(batch, H, P, dtype=torch.float64)
    for b in range(batch):
        for h in range(H):
            g = h // (H // G)
            u = float(dt[b, h]) + (float(dt_bias[h]) if dt_bias is not None else 0.0)
            delta = u if u > 20.0 else math.log1p(math.exp(u))
            delta = min(max(delta, dt_limit[0]), dt_limit[1])
            xbh = x[b, h].double()
            new[b, h] = math.exp(delta * float(A[h])) * new[b, h] + delta * torch.outer(xbh, B[b, g].double())
            y[b, h] = new[b, h] @ C[b, g].double()
            if D is not None:
                y[b, h] += float(D[h]) * xbh
            if z is not None:
                y[b, h] *= F.silu(z[b, h].double())
    return new, y


def random_step(batch=3, H=4, P=3, N=5, G=2, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    A = -torch.rand(H, generator=gen, dtype=torch.float64).add(0.3).to(dtype)
    return dict(x=r(batch, H, P), dt=r(batch, H), A=A, B=r(batch, G, N), C=r(batch, G, N), D=r(H),
                z=r(batch, H, P), dt_bias=r(H))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_one_step_matches_the_recurrence_and_updates_state_in_place(groups):
    inputs = random_step(G=groups, seed=groups)
    state = torch.randn(3, 4, 3, 5, dtype=torch.float64)
    expected_state, expected_y = reference_step(state, **inputs)
    storage = state.clone()
    y = selective_state_update(storage, **inputs)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(storage, expected_state)


def test_float32_state_with_bfloat16_activations_keeps_state_precision():
    inputs = random_step(seed=7)
    low = {k: (v.bfloat16() if k in ("x", "B", "C", "z", "dt") else v.float()) for k, v in inputs.items()}
    state = torch.randn(3, 4, 3, 5)
    expected_state, expected_y = reference_step(state, **low)
    y = selective_state_update(state, **low)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(state.double(), expected_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.double(), expected_y, atol=3e-2, rtol=2e-2)


def test_slot_indices_update_only_the_named_slots():
    inputs = random_step(batch=2, seed=11)
    pool = torch.randn(6, 4, 3, 5, dtype=torch.float64)
    before = pool.clone()
    slots = torch.tensor([4, 1])
    y = selective_state_update(pool, **inputs, state_batch_indices=slots)
    expected_state, expected_y = reference_step(before[slots], **inputs)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(pool[slots], expected_state)
    for untouched in (0, 2, 3, 5):
        torch.testing.assert_close(pool[untouched], before[untouched], atol=0.0, rtol=0.0)


def test_dt_limit_is_applied_after_softplus():
    inputs = random_step(seed=5)
    inputs["dt"] = inputs["dt"] * 10.0
    state = torch.randn(3, 4, 3, 5, dtype=torch.float64)
    expected_state, expected_y = reference_step(state, **inputs, dt_limit=(0.1, 0.5))
    y = selective_state_update(state, **inputs, dt_limit=(0.1, 0.5))
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(state, expected_state)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decode_loop_after_prefill_equals_scan_of_the_whole(dtype):
    T, prefix, H, P, N, G = 12, 5, 4, 3, 5, 2
    gen = torch.Generator().manual_seed(2)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    x, dt, B, C, z = r(T, H, P), r(T, H), r(T, G, N), r(T, G, N), r(T, H, P)
    A, D, dt_bias = -torch.rand(H, dtype=torch.float64).add(0.3).to(dtype), r(H), r(H)
    init = r(1, H, P, N)
    common = dict(D=D, dt_bias=dt_bias)
    y_all, final_all = ssd_chunk_scan_varlen(
        x, dt, A, B, C, 4, torch.tensor([0, T]), init, z=z, **common
    )
    y_pre, state = ssd_chunk_scan_varlen(
        x[:prefix], dt[:prefix], A, B[:prefix], C[:prefix], 4, torch.tensor([0, prefix]), init,
        z=z[:prefix], **common,
    )
    decoded = [
        selective_state_update(state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1],
                               z=z[t : t + 1], **common)
        for t in range(prefix, T)
    ]
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(torch.cat([y_pre, *decoded]), y_all, atol=tol, rtol=tol)
    torch.testing.assert_close(state, final_all, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_update_matches_cpu_update():
    inputs = random_step(dtype=torch.float32, seed=13)
    pool = torch.randn(5, 4, 3, 5)
    slots = torch.tensor([4, 0, 2])
    pool_gpu = pool.cuda()
    y_cpu = selective_state_update(pool, **inputs, state_batch_indices=slots)
    y_gpu = selective_state_update(
        pool_gpu, **{k: v.cuda() for k, v in inputs.items()}, state_batch_indices=slots.cuda()
    )
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_gpu.cpu(), pool, atol=1e-5, rtol=1e-5)

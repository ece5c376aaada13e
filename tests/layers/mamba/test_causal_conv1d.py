"""Causal depthwise conv1d with state: impulse response, state carry-over, packing and decode updates."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from strata.errors import ConfigError
from strata.layers.mamba.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen


def reference_conv(x, weight, bias, state, activation):
    """One sequence, float64, explicit loops: x [T, C], state [C, K-1] oldest first (None = zeros)."""
    T, C = x.shape
    K = weight.shape[1]
    history = [torch.zeros(C, dtype=torch.float64) for _ in range(K - 1)]
    if state is not None:
        history = [state[:, j].double() for j in range(K - 1)]
    out = torch.zeros(T, C, dtype=torch.float64)
    for t in range(T):
        history.append(x[t].double())
        window = history[-K:]
        for c in range(C):
            acc = sum(float(weight[c, k]) * float(window[k][c]) for k in range(K))
            out[t, c] = acc + (float(bias[c]) if bias is not None else 0.0)
    if activation == "silu":
        out = F.silu(out)
    final = torch.stack(history[-(K - 1):], dim=1) if K > 1 else torch.zeros(C, 0, dtype=torch.float64)
    return out, final


def bounds(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_impulse_response_is_the_reversed_kernel():
    C, K, T, t0 = 3, 4, 9, 2
    weight = torch.randn(C, K, dtype=torch.float64)
    x = torch.zeros(T, C, dtype=torch.float64)
    x[t0] = 1.0
    out, _ = causal_conv1d_varlen(x, weight, None, bounds([T]), None, None, activation=None)
    torch.testing.assert_close(out[:t0], torch.zeros(t0, C, dtype=torch.float64))
    for j in range(K):
        torch.testing.assert_close(out[t0 + j], weight[:, K - 1 - j])
    torch.testing.assert_close(out[t0 + K :], torch.zeros(T - t0 - K, C, dtype=torch.float64))


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prefill_matches_explicit_loop_with_bias_and_state(activation, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=gen).to(dtype)
    weight, bias = torch.randn(5, 4, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)
    state = torch.randn(1, 5, 3, generator=gen).to(dtype)
    out, final = causal_conv1d_varlen(x, weight, bias, bounds([6]), state, torch.tensor([True]), activation)
    out_ref, final_ref = reference_conv(x, weight, bias, state[0], activation)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert out.dtype == dtype and final.dtype == dtype
    torch.testing.assert_close(out.double(), out_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(final[0].double(), final_ref, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("length", [1, 2, 3, 5])
def test_final_state_is_last_raw_inputs_reaching_into_the_old_state(length):
    C, K = 2, 4
    state = torch.arange(C * (K - 1), dtype=torch.float32).view(1, C, K - 1) + 100.0
    x = torch.arange(length * C, dtype=torch.float32).view(length, C)
    _, final = causal_conv1d_varlen(x, torch.randn(C, K), None, bounds([length]), state, torch.tensor([True]))
    expected = torch.cat([state[0], x.t()], dim=1)[:, -(K - 1):]
    torch.testing.assert_close(final[0], expected, atol=0.0, rtol=0.0)


def test_packed_sequences_equal_separate_runs_and_ignore_unflagged_states():
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 1, 2, 7]
    C, K = 6, 4
    x = torch.randn(sum(lengths), C, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(C, K, generator=gen, dtype=torch.float64), torch.randn(C, dtype=torch.float64)
    states = torch.randn(4, C, K - 1, generator=gen, dtype=torch.float64)
    has_state = torch.tensor([True, False, True, False])
    states[1] = math.nan  # an unflagged slot may hold garbage
    qsl = bounds(lengths)
    out, final = causal_conv1d_varlen(x, weight, bias, qsl, states, has_state)
    for i in range(4):
        part = slice(int(qsl[i]), int(qsl[i + 1]))
        used = states[i] if has_state[i] else None
        out_ref, final_ref = reference_conv(x[part], weight, bias, used, "silu")
        torch.testing.assert_close(out[part], out_ref)
        torch.testing.assert_close(final[i], final_ref)


def test_decode_updates_continue_a_prefill_like_one_long_prefill():
    gen = torch.Generator().manual_seed(3)
    lengths, C, K, steps = [4, 2], 5, 4, 3
    x = torch.randn(sum(lengths), C, generator=gen)
    weight, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    out, state = causal_conv1d_varlen(x, weight, bias, bounds(lengths), None, None)
    new_tokens = torch.randn(steps, 2, C, generator=gen)
    decoded = [causal_conv1d_update(new_tokens[s], state, weight, bias) for s in range(steps)]
    for i, (start, n) in enumerate([(0, 4), (4, 2)]):
        whole = torch.cat([x[start : start + n], new_tokens[:, i]])
        out_all, final_all = causal_conv1d_varlen(whole, weight, bias, bounds([n + steps]), None, None)
        torch.testing.assert_close(out[start : start + n], out_all[:n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(torch.stack([d[i] for d in decoded]), out_all[n:], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state[i], final_all[0])


def test_update_with_slot_indices_touches_only_those_slots_of_a_transposed_pool():
    gen = torch.Generator().manual_seed(4)
    C, K = 3, 4
    storage = torch.randn(5, K - 1, C, generator=gen)  # vLLM V1 layout; the kernel sees the [C, K-1] view
    pool = storage.transpose(1, 2)
    before = pool.clone()
    slots = torch.tensor([3, 0])
    x = torch.randn(2, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    out = causal_conv1d_update(x, pool, weight, None, activation=None, conv_state_indices=slots)
    for b, slot in enumerate(slots.tolist()):
        window = torch.cat([before[slot], x[b][:, None]], dim=1)
        torch.testing.assert_close(out[b], (window * weight).sum(1))
        torch.testing.assert_close(pool[slot], window[:, 1:])
    for untouched in (1, 2, 4):
        torch.testing.assert_close(pool[untouched], before[untouched], atol=0.0, rtol=0.0)


def test_update_without_indices_writes_through_a_view_in_place():
    buffer = torch.zeros(2, 2, 3, dtype=torch.bfloat16)
    state = buffer[1:]
    causal_conv1d_update(torch.tensor([[1.0, 2.0]]), state, torch.ones(2, 4), None)
    causal_conv1d_update(torch.tensor([[3.0, 4.0]]), state, torch.ones(2, 4), None)
    expected = torch.tensor([[0.0, 1.0, 3.0], [0.0, 2.0, 4.0]], dtype=torch.bfloat16)
    torch.testing.assert_close(buffer[1], expected)
    torch.testing.assert_close(buffer[0], torch.zeros(2, 3, dtype=torch.bfloat16))


def test_unknown_activation_is_rejected():
    with pytest.raises(ConfigError):
        causal_conv1d_update(torch.zeros(1, 2), torch.zeros(1, 2, 3), torch.zeros(2, 4), None, "relu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_conv_matches_cpu_conv():
    gen = torch.Generator().manual_seed(5)
    x, weight, bias = torch.randn(12, 8, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(8)
    states, has_state = torch.randn(3, 8, 3, generator=gen), torch.tensor([True, False, True])
    qsl = bounds([2, 6, 4])
    out_cpu, final_cpu = causal_conv1d_varlen(x, weight, bias, qsl, states, has_state)
    out_gpu, final_gpu = causal_conv1d_varlen(
        x.cuda(), weight.cuda(), bias.cuda(), qsl.cuda(), states.cuda(), has_state.cuda()
    )
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final_gpu.cpu(), final_cpu)
    pool = states.clone()
    step_cpu = causal_conv1d_update(x[:2], pool, weight, bias, conv_state_indices=torch.tensor([2, 0]))
    pool_gpu = states.cuda()
    step_gpu = causal_conv1d_update(
        x[:2].cuda(), pool_gpu, weight.cuda(), bias.cuda(), conv_state_indices=torch.tensor([2, 0]).cuda()
    )
    torch.testing.assert_close(step_gpu.cpu(), step_cpu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_gpu.cpu(), pool)


def test_empty_sequence_keeps_its_state():
    states = torch.randn(2, 3, 3)
    x = torch.randn(2, 3)
    out, final = causal_conv1d_varlen(x, torch.randn(3, 4), None, bounds([0, 2]), states, torch.tensor([True, True]))
    assert out.shape == (2, 3)
    torch.testing.assert_close(final[0], states[0])
    torch.testing.assert_close(final[1], torch.cat([states[1], x.t()], dim=1)[:, -3:])

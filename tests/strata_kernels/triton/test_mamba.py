"""Triton Mamba2 kernels (conv1d, SSD scan, state update) against their torch references, reading and
writing slot pools in place: interpreter tests on CPU with small shapes, `gpu` tests at realistic sizes."""
from __future__ import annotations

import math
import os

import pytest
import torch

from strata.kernels.triton import causal_conv1d as tconv
from strata.kernels.triton import ssd as tssd
from strata.kernels.triton import state_update as tsu
from strata.layers.mamba import causal_conv1d as rconv
from strata.layers.mamba import ssd as rssd
from strata.layers.mamba import state_update as rsu

# Lengths 1 and 2 are shorter than K-1 = 3; 9 spans three chunks of 4; several are not multiples of 4.
LENGTHS = [1, 2, 9, 4, 3]
HAS_INITIAL = [True, False, True, False, True]
SLOTS = [7, 2, 5, 0, 11]  # shuffled; the other slots of the pool hold NaN
NUM_SLOTS = 12


def bounds(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def poisoned(pool: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """NaN in every slot but `keep`: unused slots and fresh sequences' slots must never leak into results."""
    mask = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    mask[keep] = False
    pool[mask] = float("nan")
    return pool


def randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


def strided(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as a view with a padded row stride, as the slices of a fused projection are."""
    wide = torch.full((t.shape[0], t[0].numel() + pad), float("nan"), dtype=t.dtype, device=t.device)
    wide[:, pad:] = t.reshape(t.shape[0], -1)
    return wide[:, pad:].view(t.shape)


def conv_pool(channels, width, dtype, gen, device="cpu"):
    # Stored [slots, K-1, C] and seen as [slots, C, K-1], as allocate_states binds it.
    return randn(gen, NUM_SLOTS, width - 1, channels, dtype=dtype, device=device).transpose(1, 2)


def run_conv_varlen(lengths, flags, slots, channels, width, bias, activation, dtype, device="cpu", seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    qsl = bounds(lengths, device)
    x = strided(randn(gen, sum(lengths), channels, dtype=dtype, device=device))
    weight = randn(gen, channels, width, dtype=dtype, device=device)
    b = randn(gen, channels, dtype=dtype, device=device) if bias else None
    slots = torch.tensor(slots, device=device)
    flags = torch.tensor(flags, device=device)
    pool = poisoned(conv_pool(channels, width, dtype, gen, device), slots[flags])
    ref_pool = pool.clone()
    out = tconv.causal_conv1d_varlen(x, weight, b, qsl, pool, slots, flags, activation)
    ref_out, final = rconv.causal_conv1d_varlen(x, weight, b, qsl, ref_pool[slots], flags, activation)
    ref_pool[slots] = final
    return out, ref_out, pool, ref_pool


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_varlen_matches_reference_and_updates_slots_in_place(bias, activation):
    out, ref_out, pool, ref_pool = run_conv_varlen(LENGTHS, HAS_INITIAL, SLOTS, 6, 4, bias, activation, torch.float32)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert pool.isnan().sum() == ref_pool.isnan().sum() > 0  # untouched slots keep their garbage


def test_conv_varlen_bfloat16_within_rounding():
    out, ref_out, pool, ref_pool = run_conv_varlen(LENGTHS, HAS_INITIAL, SLOTS, 6, 4, True, "silu", torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0, equal_nan=True)  # raw inputs, copied exactly


@pytest.mark.parametrize("bias", [True, False])
def test_conv_update_matches_reference_in_place_on_shuffled_slots(bias):
    gen = torch.Generator().manual_seed(1)
    channels, width = 6, 4
    slots = torch.tensor([5, 0, 9])
    x = strided(randn(gen, 3, channels))
    weight = randn(gen, channels, width)
    b = randn(gen, channels) if bias else None
    pool = poisoned(conv_pool(channels, width, torch.float32, gen), slots)
    ref_pool = pool.clone()
    out = tconv.causal_conv1d_update(x, pool, weight, b, "silu", slots)
    ref_out = rconv.causal_conv1d_update(x, ref_pool, weight, b, "silu", slots)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0, equal_nan=True)


def make_scan_inputs(lengths, heads, head_dim, groups, dstate, dtype, gen, device="cpu"):
    t = sum(lengths)
    # x, B and C are slices of one fused tensor in the mixer: strided views here.
    return dict(
        x=strided(randn(gen, t, heads, head_dim, dtype=dtype, device=device)),
        dt=strided(randn(gen, t, heads, dtype=dtype, device=device) - 1.0),
        A=-torch.rand(heads, generator=gen, device=device) - 0.5,
        B=strided(randn(gen, t, groups, dstate, dtype=dtype, device=device, scale=dstate ** -0.5)),
        C=strided(randn(gen, t, groups, dstate, dtype=dtype, device=device, scale=dstate ** -0.5)),
    )


def run_scan(lengths, flags, slots, chunk_size, *, heads=4, head_dim=4, groups=2, dstate=8, with_d=True,
             with_z=True, dt_limit=(0.0, math.inf), dtype=torch.float32, state_dtype=torch.float32, device="cpu"):
    gen = torch.Generator(device).manual_seed(2)
    inputs = make_scan_inputs(lengths, heads, head_dim, groups, dstate, dtype, gen, device)
    D = randn(gen, heads, device=device) if with_d else None
    z = randn(gen, sum(lengths), heads, head_dim, dtype=dtype, device=device) if with_z else None
    dt_bias = randn(gen, heads, device=device)
    slots = torch.tensor(slots, device=device)
    flags = torch.tensor(flags, device=device)
    pool = poisoned(randn(gen, NUM_SLOTS, heads, head_dim, dstate, dtype=state_dtype, device=device), slots[flags])
    ref_pool = pool.clone()
    qsl = bounds(lengths)
    chunks = tssd.scan_chunks(qsl, chunk_size, device)
    y = tssd.ssd_chunk_scan_varlen(**inputs, chunks=chunks, ssm_state=pool, state_slots=slots,
                                   has_initial_state=flags, D=D, z=z, dt_bias=dt_bias, dt_limit=dt_limit)
    initial = torch.where(flags[:, None, None, None], ref_pool[slots].float(), 0.0)
    ref_y, final = rssd.ssd_chunk_scan_varlen(**inputs, chunk_size=chunk_size, query_start_loc=qsl.to(device),
                                              initial_states=initial, D=D, z=z, dt_bias=dt_bias, dt_limit=dt_limit)
    ref_pool[slots] = final.to(state_dtype)
    return y, ref_y, pool, ref_pool


@pytest.mark.parametrize("with_d,with_z,dt_limit", [
    (True, True, (0.0, math.inf)),
    (False, False, (0.05, 1.5)),
    (True, False, (0.0, 2.0)),
])
def test_scan_matches_reference_across_chunks_and_slots(with_d, with_z, dt_limit):
    y, ref_y, pool, ref_pool = run_scan(LENGTHS, HAS_INITIAL, SLOTS, 4, with_d=with_d, with_z=with_z,
                                        dt_limit=dt_limit)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert pool.isnan().sum() == ref_pool.isnan().sum() > 0


def test_scan_one_group_per_head_wide_tiles_and_chunk_of_eight():
    # head_dim and dstate above the interpreter's 32-wide tiles: several P and N blocks
    y, ref_y, pool, ref_pool = run_scan([3, 17, 8], [False, True, True], [1, 4, 3], 8, heads=2, groups=2,
                                        head_dim=40, dstate=40)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_scan_bfloat16_inputs_and_states_within_rounding():
    y, ref_y, pool, ref_pool = run_scan(LENGTHS, HAS_INITIAL, SLOTS, 4, dtype=torch.bfloat16,
                                        state_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref_y.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(pool.float(), ref_pool.float(), atol=5e-2, rtol=5e-2, equal_nan=True)


def test_scan_chunks_never_cross_sequences():
    chunks = tssd.scan_chunks([0, 3, 3, 12], 4, "cpu")
    assert chunks.chunk_start.tolist() == [0, 3, 7, 11]
    assert chunks.chunk_end.tolist() == [3, 7, 11, 12]
    assert chunks.seq_chunks.tolist() == [0, 1, 1, 4]


def run_state_update(batch, slots, *, heads=4, head_dim=4, groups=2, dstate=8, with_d=True, with_z=True,
                     dt_limit=(0.0, math.inf), dtype=torch.float32, state_dtype=torch.float32, device="cpu"):
    gen = torch.Generator(device).manual_seed(3)
    inputs = make_scan_inputs([batch], heads, head_dim, groups, dstate, dtype, gen, device)
    D = randn(gen, heads, device=device) if with_d else None
    z = randn(gen, batch, heads, head_dim, dtype=dtype, device=device) if with_z else None
    dt_bias = randn(gen, heads, device=device)
    slots = torch.tensor(slots, device=device)
    pool = poisoned(randn(gen, NUM_SLOTS, heads, head_dim, dstate, dtype=state_dtype, device=device), slots)
    ref_pool = pool.clone()
    kwargs = dict(D=D, z=z, dt_bias=dt_bias, dt_limit=dt_limit, state_batch_indices=slots)
    y = tsu.selective_state_update(pool, **inputs, **kwargs)
    ref_y = rsu.selective_state_update(ref_pool, **inputs, **kwargs)
    return y, ref_y, pool, ref_pool


@pytest.mark.parametrize("with_d,with_z,dt_limit", [(True, True, (0.0, math.inf)), (False, False, (0.05, 1.5))])
def test_state_update_matches_reference_in_place(with_d, with_z, dt_limit):
    y, ref_y, pool, ref_pool = run_state_update(3, [9, 0, 4], with_d=with_d, with_z=with_z, dt_limit=dt_limit)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_state_update_bfloat16_state_within_rounding():
    y, ref_y, pool, ref_pool = run_state_update(3, [9, 0, 4], dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    torch.testing.assert_close(y.float(), ref_y.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pool.float(), ref_pool.float(), atol=3e-2, rtol=3e-2, equal_nan=True)


# --- CUDA, realistic sizes ---------------------------------------------------------------------------------------

def _compiled_only():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run with TRITON_INTERPRET=0: the interpreter would emulate the kernels on the host")


def _assert_close_scaled(actual, expected, tol):
    """Max error relative to the largest reference value: sums of thousands of terms round differently."""
    actual, expected = actual.float(), expected.float()
    scale = expected.nan_to_num().abs().max().clamp(min=1.0)
    assert torch.equal(actual.isnan(), expected.isnan())
    err = (actual - expected).nan_to_num().abs().max() / scale
    assert err <= tol, f"max error {err:.2e} of the reference's scale, above {tol:.0e}"


GPU_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_conv_matches_reference(dtype):
    _compiled_only()
    lengths = [1, 1, 2, 700, 1500, 37, 256]
    flags = [True, False, True, False, True, True, False]
    out, ref_out, pool, ref_pool = run_conv_varlen(lengths, flags, [3, 9, 1, 0, 11, 6, 2], 4096, 4, True, "silu",
                                                   dtype, "cuda")
    _assert_close_scaled(out, ref_out, GPU_TOL[dtype])
    _assert_close_scaled(pool, ref_pool, GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,groups", [(8, 1), (64, 8)])
def test_gpu_scan_matches_reference(dtype, heads, groups):
    _compiled_only()
    lengths = [1, 300, 2048, 777, 256]
    y, ref_y, pool, ref_pool = run_scan(lengths, [True, False, True, True, False], [4, 0, 10, 2, 7], 256,
                                        heads=heads, head_dim=64, groups=groups, dstate=128, dtype=dtype,
                                        state_dtype=torch.float32, device="cuda")
    _assert_close_scaled(y, ref_y, GPU_TOL[dtype])
    _assert_close_scaled(pool, ref_pool, GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_state_update_matches_reference(dtype):
    _compiled_only()
    y, ref_y, pool, ref_pool = run_state_update(8, [4, 0, 10, 2, 7, 1, 11, 3], heads=64, head_dim=64, groups=8,
                                                dstate=128, dtype=dtype, state_dtype=dtype, device="cuda")
    _assert_close_scaled(y, ref_y, GPU_TOL[dtype])
    _assert_close_scaled(pool, ref_pool, GPU_TOL[dtype])

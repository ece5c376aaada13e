"""Triton Mamba2 one-token selective state update (decode), reading and writing the SSM-state slot pool in place.

Reference: `strata.layers.mamba.state_update.selective_state_update`.
"""
from __future__ import annotations

import math

import torch

from strata.kernels.triton.jit import jit, require_triton, tl, triton
from strata.kernels.triton.ssd import discretize

_MAX_BLOCK_P = 16


@jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, y_ptr, slots_ptr,
    head_dim, dstate, heads_per_group, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n, stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
    stride_b_b, stride_b_g, stride_b_n, stride_c_b, stride_c_g, stride_c_n, stride_z_b, stride_z_h, stride_z_p,
    stride_y_b, stride_y_h, stride_y_p,
    HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # S <- exp(Delta*A) S + Delta x (outer) B; y = S C + D x, gated by silu(z): one sequence, head, rows of P.
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < head_dim, n < dstate
    g = h // heads_per_group
    slot = tl.load(slots_ptr + b).to(tl.int64)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    delta = discretize(tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h), bias, SOFTPLUS, HAS_LIMIT, dt_min, dt_max)
    decay = tl.exp(delta * tl.load(a_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + p * stride_x_p, mask=p_ok, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + b * stride_b_b + g * stride_b_g + n * stride_b_n, mask=n_ok, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * stride_c_b + g * stride_c_g + n * stride_c_n, mask=n_ok, other=0.0).to(tl.float32)
    s_ptrs = state_ptr + slot * stride_s_slot + h * stride_s_h + p[:, None] * stride_s_p + n[None, :] * stride_s_n
    mask = p_ok[:, None] & n_ok[None, :]
    state = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    state = state * decay + (delta * x)[:, None] * bv[None, :]
    tl.debug_barrier()  # every thread has read the slot before any writes it
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(state * cv[None, :], axis=1)  # from the unrounded new state
    if HAS_D:
        y += x * tl.load(d_ptr + h).to(tl.float32)
    if HAS_Z:
        zv = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + p * stride_z_p, mask=p_ok, other=0.0).to(tl.float32)
        y *= zv / (1.0 + tl.exp(-zv))
    tl.store(y_ptr + b * stride_y_b + h * stride_y_h + p * stride_y_p, y.to(y_ptr.dtype.element_ty), mask=p_ok)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    state_batch_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """S <- exp(Delta*A) * S + Delta * x (outer) B;  y = S @ C + D*x, then y * silu(z) when z is given.

    state `[B, H, P, N]`, or with `state_batch_indices` `[B]` (distinct) a slot pool `[n_slots, H, P, N]`
    (float32 or 16-bit, any strides; updated IN PLACE); x `[B, H, P]`, dt `[B, H]` raw
    (Delta = clamp(softplus(dt + dt_bias), *dt_limit)), A `[H]` negative, B and C `[B, G, N]` (head h uses
    group h // (H // G)), D `[H]`, z `[B, H, P]`, all with any strides. Math in float32; y comes from the
    unrounded new state. Returns y `[B, H, P]` in x's dtype. No host synchronisation.
    """
    require_triton()
    batch, num_heads, head_dim = x.shape
    groups, dstate = B.shape[1], B.shape[2]
    y = torch.empty((batch, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    if state_batch_indices is None:
        state_batch_indices = torch.arange(batch, device=x.device, dtype=torch.int32)
    block_p = min(_MAX_BLOCK_P, triton.next_power_of_2(head_dim))
    low, high = dt_limit
    zz = z if z is not None else x
    _state_update_kernel[(batch, num_heads, triton.cdiv(head_dim, block_p))](
        state, x, dt, dt_bias if dt_bias is not None else A, A, B, C, D if D is not None else A, zz, y,
        state_batch_indices, head_dim, dstate, num_heads // groups, float(low), float(min(high, 3.0e38)),
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(),
        HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=low > 0.0 or high != math.inf,
        HAS_D=D is not None, HAS_Z=z is not None, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(dstate))
    return y

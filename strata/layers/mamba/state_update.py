"""Mamba2 single-token SSM state update (decode): one recurrence step per sequence, state updated in place."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from strata.layers.mamba.ssd import compute_dtype, discretize_dt, heads_by_group


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

    state `[B, H, P, N]` (any dtype; updated IN PLACE), x `[B, H, P]`, dt `[B, H]` raw
    (Delta = clamp(softplus(dt + dt_bias), *dt_limit)), A `[H]` negative, B and C `[B, G, N]` (head h uses
    group h // (H // G)), D `[H]`, z `[B, H, P]`. With `state_batch_indices` `[B]`, state is a slot pool
    `[n_slots, H, P, N]` and sequence b uses slot `state_batch_indices[b]`.
    Math in float32 (float64 for float64 x); y comes from the unrounded new state, as in vLLM's kernel.
    Returns y `[B, H, P]` in x's dtype.
    """
    num_heads = x.shape[1]
    dtype = compute_dtype(x)
    delta = discretize_dt(dt, dt_bias, dt_softplus, dt_limit).to(dtype)  # [B, H]
    decay = torch.exp(delta * A.to(dtype))
    b_heads = heads_by_group(B.to(dtype), num_heads)  # [B, H, N]
    c_heads = heads_by_group(C.to(dtype), num_heads)
    xc = x.to(dtype)

    old = state if state_batch_indices is None else state[state_batch_indices]
    inflow = (delta[:, :, None] * xc)[..., None] * b_heads[:, :, None, :]  # Delta * x (outer) B
    new = old.to(dtype) * decay[:, :, None, None] + inflow
    if state_batch_indices is None:
        state.copy_(new)
    else:
        state[state_batch_indices] = new.to(state.dtype)

    y = torch.matmul(new, c_heads[..., None]).squeeze(-1)
    if D is not None:
        y = y + D.to(dtype)[:, None] * xc
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(x.dtype)

"""Triton causal depthwise conv1d for Mamba: packed varlen prefill and the one-token decode update, both
reading and writing the conv-state slot pool `[slots, C, K-1]` in place, whatever its strides.

References: `strata.layers.mamba.causal_conv1d` (same semantics, states gathered and scattered around it).
"""
from __future__ import annotations

import torch

from strata.errors import ConfigError
from strata.kernels.triton.jit import jit, require_triton, tl, triton

_BLOCK_T = 32  # tokens per program of the prefill kernel
_MAX_BLOCK_C = 128


def _check_activation(activation: str | None) -> bool:
    """True for silu."""
    if activation not in (None, "silu", "swish"):
        raise ConfigError(f"causal_conv1d supports activation None or 'silu', got {activation!r}")
    return activation is not None


@jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, qsl_ptr, seq_of_token_ptr, slots_ptr, init_ptr,
    num_tokens, channels,
    stride_x_t, stride_x_c, stride_w_c, stride_w_k, stride_o_t, stride_o_c, stride_s_slot, stride_s_c, stride_s_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_FLAGS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # A block of packed tokens (possibly of several sequences) x a block of channels; a window reaching
    # before its sequence's first token reads the sequence's initial state from its slot instead.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < num_tokens
    c_ok = c < channels
    seq = tl.load(seq_of_token_ptr + t, mask=t_ok, other=0)
    start = tl.load(qsl_ptr + seq, mask=t_ok, other=0)
    slot = tl.load(slots_ptr + seq, mask=t_ok, other=0).to(tl.int64)
    use_state = t_ok
    if HAS_FLAGS:
        use_state = use_state & (tl.load(init_ptr + seq, mask=t_ok, other=0) != 0)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        pos = t - (WIDTH - 1) + k
        in_seq = pos >= start
        x_mask = (t_ok & in_seq)[:, None] & c_ok[None, :]
        xv = tl.load(x_ptr + pos.to(tl.int64)[:, None] * stride_x_t + c[None, :] * stride_x_c, mask=x_mask, other=0.0)
        col = (WIDTH - 1) + pos - start  # state column, meaningful only before the sequence starts
        s_mask = (use_state & (pos < start))[:, None] & c_ok[None, :]
        s_ptrs = state_ptr + slot[:, None] * stride_s_slot + c[None, :] * stride_s_c + col[:, None] * stride_s_k
        sv = tl.load(s_ptrs, mask=s_mask, other=0.0)
        w = tl.load(w_ptr + c * stride_w_c + k * stride_w_k, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    o_ptrs = out_ptr + t.to(tl.int64)[:, None] * stride_o_t + c[None, :] * stride_o_c
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@jit
def _conv_final_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slots_ptr, init_ptr, channels,
    stride_x_t, stride_x_c, stride_s_slot, stride_s_c, stride_s_k,
    WIDTH: tl.constexpr, HAS_FLAGS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Each sequence's last K-1 raw inputs, reaching back into its old state when it is shorter than K-1.
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_K)
    c_ok = c < channels
    j_ok = j < WIDTH - 1
    start = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    src = length - (WIDTH - 1) + j  # position within the sequence of the input that lands in column j
    from_x = (src >= 0) & j_ok
    x_ptrs = x_ptr + (start + src).to(tl.int64)[None, :] * stride_x_t + c[:, None] * stride_x_c
    xv = tl.load(x_ptrs, mask=c_ok[:, None] & from_x[None, :], other=0.0)
    from_old = (src < 0) & j_ok
    if HAS_FLAGS:  # loaded as a vector: the interpreter does not broadcast a scalar into a mask
        from_old = from_old & (tl.load(init_ptr + seq + j * 0) != 0)
    old_mask = c_ok[:, None] & from_old[None, :]
    row = state_ptr + slot * stride_s_slot + c[:, None] * stride_s_c
    old = tl.load(row + (length + j)[None, :] * stride_s_k, mask=old_mask, other=0.0)
    new = xv.to(tl.float32) + old.to(tl.float32)
    tl.debug_barrier()  # every old column is read before any is overwritten
    tl.store(row + j[None, :] * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=c_ok[:, None] & j_ok[None, :])


@jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, slots_ptr, channels,
    stride_x_b, stride_x_c, stride_w_c, stride_w_k, stride_o_b, stride_o_c, stride_s_slot, stride_s_c, stride_s_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_K)
    c_ok = c < channels
    j_ok = j < WIDTH - 1
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = state_ptr + slot * stride_s_slot + c[:, None] * stride_s_c
    mask = c_ok[:, None] & j_ok[None, :]
    old = tl.load(row + j[None, :] * stride_s_k, mask=mask, other=0.0).to(tl.float32)
    w_old = tl.load(w_ptr + c[:, None] * stride_w_c + j[None, :] * stride_w_k, mask=mask, other=0.0)
    xv = tl.load(x_ptr + b * stride_x_b + c * stride_x_c, mask=c_ok, other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + c * stride_w_c + (WIDTH - 1) * stride_w_k, mask=c_ok, other=0.0).to(tl.float32)
    acc = tl.sum(old * w_old.to(tl.float32), axis=1) + xv * w_new
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    # Shift left by one: column j takes old column j+1, the last takes x.
    shifted = tl.load(row + (j + 1)[None, :] * stride_s_k, mask=c_ok[:, None] & (j + 1 < WIDTH - 1)[None, :],
                      other=0.0).to(tl.float32)
    new = tl.where((j == WIDTH - 2)[None, :], xv[:, None], shifted)
    tl.debug_barrier()  # every old column is read before any is overwritten
    tl.store(row + j[None, :] * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + b * stride_o_b + c * stride_o_c, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


def _blocks(channels: int, width: int) -> tuple[int, int]:
    return min(_MAX_BLOCK_C, triton.next_power_of_2(channels)), max(2, triton.next_power_of_2(width - 1))


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over packed sequences, each continuing from its slot and leaving its final
    state there.

    x `[T, C]` (any strides); weight `[C, K]`; bias `[C]` or None; query_start_loc `[S+1]` cumulative
    offsets on x's device; conv_state the slot pool `[slots, C, K-1]` (oldest first, any strides, updated
    IN PLACE); state_slots `[S]` distinct slot per sequence; has_initial_state `[S]` bool (False: start
    from zeros, whatever the slot holds) or None (all continue). Accumulates in float32.
    Returns out `[T, C]` in x's dtype. No host synchronisation.
    """
    require_triton()
    silu = _check_activation(activation)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = query_start_loc.numel() - 1
    out = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    block_c, block_k = _blocks(channels, width)
    flags = has_initial_state if has_initial_state is not None else state_slots  # unused when HAS_FLAGS is off
    common = dict(WIDTH=width, HAS_FLAGS=has_initial_state is not None, BLOCK_C=block_c)
    if num_tokens:
        bounds = query_start_loc[1:]
        seq_of_token = torch.searchsorted(bounds, torch.arange(num_tokens, device=x.device, dtype=bounds.dtype),
                                          right=True)
        grid = (triton.cdiv(num_tokens, _BLOCK_T), triton.cdiv(channels, block_c))
        _conv_varlen_kernel[grid](
            x, weight, bias if bias is not None else weight, out, conv_state, query_start_loc, seq_of_token,
            state_slots, flags, num_tokens, channels, *x.stride(), *weight.stride(), *out.stride(),
            *conv_state.stride(), HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=_BLOCK_T, **common)
    if width > 1:
        _conv_final_state_kernel[(num_seqs, triton.cdiv(channels, block_c))](
            x, conv_state, query_start_loc, state_slots, flags, channels, *x.stride(), *conv_state.stride(),
            BLOCK_K=block_k, **common)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per sequence: x `[B, C]`; conv_state `[B, C, K-1]`, or with `conv_state_indices`
    `[B]` (distinct) a slot pool `[n_slots, C, K-1]`, any strides, shifted and updated IN PLACE.
    Accumulates in float32. Returns out `[B, C]` in x's dtype.
    """
    require_triton()
    silu = _check_activation(activation)
    batch, channels = x.shape
    width = weight.shape[1]
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    if width < 2:
        raise ConfigError("causal_conv1d_update needs a kernel width of at least 2")
    if conv_state_indices is None:
        conv_state_indices = torch.arange(batch, device=x.device, dtype=torch.int32)
    block_c, block_k = _blocks(channels, width)
    _conv_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, out, conv_state, conv_state_indices, channels,
        *x.stride(), *weight.stride(), *out.stride(), *conv_state.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block_c, BLOCK_K=block_k)
    return out

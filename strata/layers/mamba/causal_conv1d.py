"""Causal depthwise conv1d with carried state, for Mamba prefill (packed varlen) and decode (one token).

Inputs are token-major `[tokens, channels]`; conv states are `[seqs, channels, K-1]` raw inputs, oldest first.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.errors import ConfigError
from strata.layers.mamba.ssd import compute_dtype

_ACTIVATIONS = (None, "silu", "swish")


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ConfigError(f"causal_conv1d supports activation None or 'silu', got {activation!r}")


def _extended_layout(
    query_start_loc: torch.Tensor, num_tokens: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row indices into a buffer where every sequence's K-1 state rows precede its tokens.

    Returns (token_rows [T], state_rows [S, K-1], last_rows [S, K-1]): where each token goes, where each
    sequence's initial state goes, and where its last K-1 raw inputs (the new state) end up.
    """
    device = query_start_loc.device
    starts = query_start_loc[:-1].long()
    ends = query_start_loc[1:].long()
    num_seqs = starts.numel()
    tokens = torch.arange(num_tokens, device=device)
    # searchsorted instead of repeat_interleave keeps this free of host synchronisation on CUDA.
    seq_of_token = torch.searchsorted(ends, tokens, right=True)
    token_rows = tokens + (seq_of_token + 1) * width
    offsets = torch.arange(width, device=device)
    seq_shift = torch.arange(num_seqs, device=device) * width
    state_rows = (starts + seq_shift)[:, None] + offsets
    last_rows = (ends + seq_shift)[:, None] + offsets
    return token_rows, state_rows, last_rows


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    initial_states: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over packed sequences, each continuing from its own conv state.

    x `[T, C]` packed tokens; weight `[C, K]` (`weight[:, K-1]` multiplies the current token); bias `[C]` or
    None; query_start_loc `[S+1]` cumulative offsets; initial_states `[S, C, K-1]` (oldest first) or None;
    has_initial_state `[S]` bool (False or None means zeros). Accumulates in float32 (float64 for float64 x).
    Returns (out `[T, C]` in x's dtype, final_states `[S, C, K-1]` = last K-1 raw inputs of each sequence,
    reaching back into the initial state when a sequence is shorter than K-1), the latter in the dtype of
    initial_states (x's dtype when None).
    """
    _check_activation(activation)
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    num_seqs = query_start_loc.numel() - 1
    state_dtype = x.dtype if initial_states is None else initial_states.dtype
    token_rows, state_rows, last_rows = _extended_layout(query_start_loc, num_tokens, width)

    dtype = compute_dtype(x)
    ext = x.new_zeros((num_tokens + num_seqs * width, channels), dtype=dtype)
    ext.index_copy_(0, token_rows, x.to(dtype))
    if initial_states is not None and width > 0:
        states = initial_states.to(dtype)
        if has_initial_state is not None:
            # where, not multiply: unflagged slots may hold garbage, even NaN
            flags = has_initial_state.to(device=states.device, dtype=torch.bool)[:, None, None]
            states = torch.where(flags, states, torch.zeros((), dtype=dtype, device=states.device))
        ext.index_copy_(0, state_rows.reshape(-1), states.transpose(1, 2).reshape(-1, channels))

    w = weight.to(dtype)
    # Row r of `u` is the conv output whose window ends at ext row r + width; in-place ops because large
    # fresh buffers are expensive on CPU.
    rows = ext.shape[0] - width
    u = ext[0:rows] * w[:, 0]
    for k in range(1, width + 1):
        u.addcmul_(ext[k : k + rows], w[:, k])
    if num_seqs > 1:  # with one sequence, its rows are exactly the token rows
        u = u.index_select(0, token_rows - width)
    if bias is not None:
        u += bias.to(dtype)
    if activation is not None:
        F.silu(u, inplace=True)
    out = u.to(x.dtype)

    final_states = ext[last_rows.reshape(-1)].reshape(num_seqs, width, channels).transpose(1, 2)
    return out, final_states.to(state_dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per sequence: x `[B, C]`; conv_state `[B, C, K-1]` is shifted and updated IN PLACE.

    With `conv_state_indices` `[B]`, conv_state is a slot pool `[n_slots, C, K-1]` and sequence b uses slot
    `conv_state_indices[b]`. Accumulates in float32 (float64 for float64 x).
    Returns out `[B, C]` in x's dtype.
    """
    _check_activation(activation)
    dtype = compute_dtype(x)
    state = conv_state if conv_state_indices is None else conv_state[conv_state_indices]
    window = torch.cat([state.to(dtype), x.to(dtype)[:, :, None]], dim=2)
    u = (window * weight.to(dtype)).sum(dim=2)
    if bias is not None:
        u = u + bias.to(dtype)
    new_state = window[:, :, 1:].to(conv_state.dtype)
    if conv_state_indices is None:
        conv_state.copy_(new_state)
    else:
        conv_state[conv_state_indices] = new_state
    return (u if activation is None else F.silu(u)).to(x.dtype)

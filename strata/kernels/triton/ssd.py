"""Triton Mamba2 SSD chunked scan over packed varlen sequences, starting from and ending in the SSM-state slot
pool `[slots, H, P, N]` in place. Four launches: per-chunk cumulative decay, chunk end states, the sequential
pass of states across each sequence's chunks, and the chunk outputs.

Reference: `strata.layers.mamba.ssd.ssd_chunk_scan_varlen` (same semantics, states gathered and scattered).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata.kernels.triton.jit import interpreting, jit, require_triton, tl, triton

# Largest (token, head-dim, state) tile sides for float32 products and for 16-bit ones: the fastest measured
# on an H200 (T=8192, H=64, P=64, N=128, chunk 256): 4.7 ms float32, 0.53 ms bfloat16.
_MAX_BLOCKS = {True: (32, 64, 32), False: (32, 64, 64)}
_MIN_DOT = 16  # tl.dot needs every dimension >= 16 on a GPU
_STATE_BLOCK = 1024  # state elements per program of the state pass


@dataclass(frozen=True)
class ScanChunks:
    """A step's prefill sequences cut into chunks that never cross sequences; built once per step on the
    host, then shared by every Mamba layer. Tensors live on the device."""

    chunk_size: int
    num_chunks: int
    query_start_loc: torch.Tensor  # [S+1] token offsets
    chunk_start: torch.Tensor  # [chunks] first token of each chunk
    chunk_end: torch.Tensor  # [chunks] one past its last token
    seq_chunks: torch.Tensor  # [S+1] cumulative chunk offsets: sequence s owns chunks [seq_chunks[s], [s+1])


def scan_chunks(query_start_loc: Sequence[int] | torch.Tensor, chunk_size: int,
                device: torch.device | str) -> ScanChunks:
    """Chunk layout from host-side offsets (a list or CPU tensor `[S+1]`); one copy to the device."""
    bounds = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    starts, ends, seq_chunks = [], [], [0]
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        for first in range(begin, end, chunk_size):
            starts.append(first)
            ends.append(min(first + chunk_size, end))
        seq_chunks.append(len(starts))
    n, s = len(starts), len(bounds)
    packed = torch.tensor([*bounds, *starts, *ends, *seq_chunks], dtype=torch.int32).to(device, non_blocking=True)
    qsl, chunk_start, chunk_end, seq_offsets = packed.split([s, n, n, s])
    return ScanChunks(chunk_size, n, qsl, chunk_start, chunk_end, seq_offsets)


@jit
def discretize(dt, dt_bias, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, dt_min, dt_max):
    """Delta = clamp(softplus(dt + dt_bias), dt_min, dt_max) in float32; softplus is the identity above 20."""
    delta = dt.to(tl.float32) + dt_bias
    if SOFTPLUS:
        delta = tl.where(delta > 20.0, delta, tl.log(1.0 + tl.exp(tl.minimum(delta, 20.0))))
    if HAS_LIMIT:
        delta = tl.minimum(tl.maximum(delta, dt_min), dt_max)
    return delta


@jit
def _matmul(a, b, IEEE: tl.constexpr, DTYPE: tl.constexpr):
    # float32 inputs: exact float32 products (no tf32); 16-bit inputs: their own dtype, float32 accumulation.
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DTYPE), b.to(DTYPE))


@jit
def _cumsum_kernel(
    dt_ptr, dt_bias_ptr, a_ptr, delta_ptr, lam_ptr, chunk_start_ptr, chunk_end_ptr, num_heads, dt_min, dt_max,
    stride_dt_t, stride_dt_h,
    HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Delta and lam = inclusive cumsum of Delta*A within the chunk, stored [chunks, H, CHUNK] in float32.
    chunk = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, BLOCK_Q)
    start = tl.load(chunk_start_ptr + chunk)
    length = tl.load(chunk_end_ptr + chunk) - start
    h_ok = h < num_heads
    mask = (s < length)[:, None] & h_ok[None, :]
    dt = tl.load(dt_ptr + (start + s).to(tl.int64)[:, None] * stride_dt_t + h[None, :] * stride_dt_h, mask=mask,
                 other=0.0)
    bias = tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32) if HAS_DT_BIAS else 0.0
    delta = discretize(dt, bias, SOFTPLUS, HAS_LIMIT, dt_min, dt_max)
    delta = tl.where(mask, delta, 0.0)
    a = tl.load(a_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    lam = tl.cumsum(delta * a[None, :], axis=0)
    offs = (chunk * num_heads + h[None, :]).to(tl.int64) * CHUNK + s[:, None]
    store_mask = (s < CHUNK)[:, None] & h_ok[None, :]
    tl.store(delta_ptr + offs, delta, mask=store_mask)
    tl.store(lam_ptr + offs, lam, mask=store_mask)


@jit
def _chunk_state_kernel(
    x_ptr, b_ptr, delta_ptr, lam_ptr, states_ptr, chunk_start_ptr, chunk_end_ptr,
    num_heads, head_dim, dstate, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n,
    CHUNK: tl.constexpr, IEEE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The chunk's end state from a zero entering state: (x * exp(lam_end - lam) * Delta)^T @ B, [P, N].
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    n_blocks = tl.cdiv(dstate, BLOCK_N)
    p = (tl.program_id(2) // n_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(2) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(chunk_start_ptr + chunk)
    length = tl.load(chunk_end_ptr + chunk) - start
    row = (chunk * num_heads + h).to(tl.int64) * CHUNK
    lam_end = tl.load(lam_ptr + row + length - 1)
    x_base = x_ptr + h * stride_x_h + p[:, None] * stride_x_p
    b_base = b_ptr + (h // heads_per_group) * stride_b_g + n[None, :] * stride_b_n
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, length, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < length
        tok = (start + s).to(tl.int64)
        xs = tl.load(x_base + tok[None, :] * stride_x_t, mask=(p < head_dim)[:, None] & s_ok[None, :], other=0.0)
        lam = tl.load(lam_ptr + row + s, mask=s_ok, other=0.0)
        delta = tl.load(delta_ptr + row + s, mask=s_ok, other=0.0)
        weight = tl.where(s_ok, tl.exp(lam_end - lam) * delta, 0.0)
        bs = tl.load(b_base + tok[:, None] * stride_b_t, mask=s_ok[:, None] & (n < dstate)[None, :], other=0.0)
        acc += _matmul(xs.to(tl.float32) * weight[None, :], bs, IEEE, x_ptr.dtype.element_ty)
    offs = ((chunk * num_heads + h).to(tl.int64) * head_dim + p[:, None]) * dstate + n[None, :]
    tl.store(states_ptr + offs, acc, mask=(p < head_dim)[:, None] & (n < dstate)[None, :])


@jit
def _state_pass_kernel(
    states_ptr, entering_ptr, lam_ptr, ssm_ptr, slots_ptr, init_ptr, seq_chunks_ptr, chunk_start_ptr,
    chunk_end_ptr, num_heads, head_dim, dstate,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    CHUNK: tl.constexpr, HAS_FLAGS: tl.constexpr, BLOCK: tl.constexpr,
):
    # One sequence and head: walk its chunks from the slot's state, storing the state entering each chunk,
    # and leave the final state in the slot.
    seq = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    size = head_dim * dstate
    ok = e < size
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    slot_ptrs = ssm_ptr + slot * stride_s_slot + h * stride_s_h + (e // dstate) * stride_s_p + (e % dstate) * stride_s_n
    init_ok = ok
    if HAS_FLAGS:  # loaded as a vector: the interpreter does not broadcast a scalar into a mask
        init_ok = init_ok & (tl.load(init_ptr + seq + e * 0) != 0)
    state = tl.load(slot_ptrs, mask=init_ok, other=0.0).to(tl.float32)  # masked, so garbage never leaks
    for c in range(tl.load(seq_chunks_ptr + seq), tl.load(seq_chunks_ptr + seq + 1)):
        offs = (c * num_heads + h).to(tl.int64) * size + e
        tl.store(entering_ptr + offs, state, mask=ok)
        length = tl.load(chunk_end_ptr + c) - tl.load(chunk_start_ptr + c)
        decay = tl.exp(tl.load(lam_ptr + (c * num_heads + h).to(tl.int64) * CHUNK + length - 1))
        state = state * decay + tl.load(states_ptr + offs, mask=ok, other=0.0)
    tl.debug_barrier()  # every thread has read the slot before any writes it
    tl.store(slot_ptrs, state.to(ssm_ptr.dtype.element_ty), mask=ok)


@jit
def _chunk_scan_kernel(
    x_ptr, z_ptr, b_ptr, c_ptr, d_ptr, y_ptr, delta_ptr, lam_ptr, entering_ptr, chunk_start_ptr, chunk_end_ptr,
    num_heads, head_dim, dstate, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p, stride_z_t, stride_z_h, stride_z_p, stride_b_t, stride_b_g, stride_b_n,
    stride_c_t, stride_c_g, stride_c_n, stride_y_t, stride_y_h, stride_y_p,
    CHUNK: tl.constexpr, TILES: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Outputs of BLOCK_T rows of one chunk: exp(lam_t) C_t S_in^T + sum_{s<=t} (C_t.B_s) exp(lam_t-lam_s) Delta_s x_s.
    chunk, t0 = tl.program_id(0) // TILES, (tl.program_id(0) % TILES) * BLOCK_T
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    start = tl.load(chunk_start_ptr + chunk)
    length = tl.load(chunk_end_ptr + chunk) - start
    if t0 >= length:
        return
    g = h // heads_per_group
    t = t0 + tl.arange(0, BLOCK_T)
    t_ok, p_ok = t < length, p < head_dim
    row = (chunk * num_heads + h).to(tl.int64) * CHUNK
    lam_t = tl.load(lam_ptr + row + t, mask=t_ok, other=0.0)
    tok_t = (start + t).to(tl.int64)
    c_rows = c_ptr + tok_t[:, None] * stride_c_t + g * stride_c_g
    s_in_cols = entering_ptr + ((chunk * num_heads + h).to(tl.int64) * head_dim + p[None, :]) * dstate
    acc = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ct = tl.load(c_rows + n[None, :] * stride_c_n, mask=t_ok[:, None] & (n < dstate)[None, :], other=0.0)
        s_in = tl.load(s_in_cols + n[:, None], mask=(n < dstate)[:, None] & p_ok[None, :], other=0.0)
        acc += _matmul(ct, s_in, IEEE, x_ptr.dtype.element_ty)
    acc *= tl.exp(lam_t)[:, None]
    x_base = x_ptr + h * stride_x_h + p[None, :] * stride_x_p
    for s0 in range(0, t0 + BLOCK_T, BLOCK_T):
        s = s0 + tl.arange(0, BLOCK_T)
        s_ok = s < length
        tok_s = (start + s).to(tl.int64)
        cb = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)  # C_t . B_s
        for n0 in range(0, dstate, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            ct = tl.load(c_rows + n[None, :] * stride_c_n, mask=t_ok[:, None] & (n < dstate)[None, :], other=0.0)
            bs = tl.load(b_ptr + tok_s[None, :] * stride_b_t + g * stride_b_g + n[:, None] * stride_b_n,
                         mask=(n < dstate)[:, None] & s_ok[None, :], other=0.0)
            cb += _matmul(ct, bs, IEEE, x_ptr.dtype.element_ty)
        lam_s = tl.load(lam_ptr + row + s, mask=s_ok, other=0.0)
        delta_s = tl.load(delta_ptr + row + s, mask=s_ok, other=0.0)
        causal = (t[:, None] >= s[None, :]) & s_ok[None, :]
        decay = tl.exp(tl.minimum(lam_t[:, None] - lam_s[None, :], 0.0))  # the min defuses the masked part
        weight = tl.where(causal, cb * decay * delta_s[None, :], 0.0)
        xs = tl.load(x_base + tok_s[:, None] * stride_x_t, mask=s_ok[:, None] & p_ok[None, :], other=0.0)
        acc += _matmul(weight, xs, IEEE, x_ptr.dtype.element_ty)
    out_mask = t_ok[:, None] & p_ok[None, :]
    if HAS_D:
        xt = tl.load(x_base + tok_t[:, None] * stride_x_t, mask=out_mask, other=0.0).to(tl.float32)
        acc += xt * tl.load(d_ptr + h).to(tl.float32)
    if HAS_Z:
        zt = tl.load(z_ptr + tok_t[:, None] * stride_z_t + h * stride_z_h + p[None, :] * stride_z_p, mask=out_mask,
                     other=0.0).to(tl.float32)
        acc *= zt / (1.0 + tl.exp(-zt))
    y_ptrs = y_ptr + tok_t[:, None] * stride_y_t + h * stride_y_h + p[None, :] * stride_y_p
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _blocks(chunk_size: int, head_dim: int, dstate: int, ieee: bool) -> tuple[int, int, int]:
    return tuple(min(most, max(_MIN_DOT, triton.next_power_of_2(size)))
                 for most, size in zip(_MAX_BLOCKS[ieee], (chunk_size, head_dim, dstate), strict=True))


def _chunk_decay(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, A: torch.Tensor, chunks: ScanChunks, dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Delta, lam = within-chunk inclusive cumsum of Delta*A), each `[chunks, H, chunk_size]` float32."""
    n, q, num_heads = chunks.num_chunks, chunks.chunk_size, dt.shape[1]
    delta, lam = torch.empty((2, n, num_heads, q), dtype=torch.float32, device=dt.device).unbind(0)
    low, high = dt_limit
    if n:
        block_h = min(16, triton.next_power_of_2(num_heads))
        _cumsum_kernel[(n, triton.cdiv(num_heads, block_h))](
            dt, dt_bias if dt_bias is not None else A, A, delta, lam, chunks.chunk_start, chunks.chunk_end,
            num_heads, float(low), float(min(high, 3.0e38)), *dt.stride(),
            HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=low > 0.0 or high != math.inf,
            CHUNK=q, BLOCK_Q=triton.next_power_of_2(q), BLOCK_H=block_h)
    return delta, lam


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunks: ScanChunks,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """Chunked SSD scan of packed sequences from and to their state slots; equals the per-token recurrence.

    x `[T, H, P]`, dt `[T, H]` raw (Delta = clamp(softplus(dt + dt_bias), *dt_limit)), A `[H]` (<= 0),
    B and C `[T, G, N]` (head h uses group h // (H // G)), all with any strides; chunks from `scan_chunks`
    over this call's query_start_loc; ssm_state the slot pool `[slots, H, P, N]` (float32 or 16-bit, any
    strides): sequence s starts from slot state_slots[s] (distinct) where has_initial_state[s] (None: all),
    from zeros otherwise, and its final state is written back there IN PLACE. D `[H]` skip, z `[T, H, P]`
    gate applied as `y * silu(z)` after the D skip. float32 accumulation, float32 products for float32 x.
    Returns y `[T, H, P]` in x's dtype. No host synchronisation.
    """
    require_triton()
    num_tokens, num_heads, head_dim = x.shape
    groups, dstate = B.shape[1], B.shape[2]
    num_seqs, n, q = chunks.query_start_loc.numel() - 1, chunks.num_chunks, chunks.chunk_size
    y = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return y
    delta, lam = _chunk_decay(dt, dt_bias, A, chunks, dt_softplus, dt_limit)
    states, entering = torch.empty((2, n, num_heads, head_dim, dstate), dtype=torch.float32,
                                   device=x.device).unbind(0)
    # The interpreter's 16-bit tl.dot returns garbage (Triton 3.9): there 16-bit inputs take float32 products too.
    ieee = x.dtype == torch.float32 or interpreting()
    block_t, block_p, block_n = _blocks(q, head_dim, dstate, ieee)
    if n:
        _chunk_state_kernel[(n, num_heads, triton.cdiv(head_dim, block_p) * triton.cdiv(dstate, block_n))](
            x, B, delta, lam, states, chunks.chunk_start, chunks.chunk_end, num_heads, head_dim, dstate,
            num_heads // groups, *x.stride(), *B.stride(),
            CHUNK=q, IEEE=ieee, BLOCK_S=block_t, BLOCK_P=block_p, BLOCK_N=block_n)
    block = min(_STATE_BLOCK, triton.next_power_of_2(head_dim * dstate))
    _state_pass_kernel[(num_seqs, num_heads, triton.cdiv(head_dim * dstate, block))](
        states, entering, lam, ssm_state, state_slots,
        has_initial_state if has_initial_state is not None else state_slots, chunks.seq_chunks,
        chunks.chunk_start, chunks.chunk_end, num_heads, head_dim, dstate, *ssm_state.stride(),
        CHUNK=q, HAS_FLAGS=has_initial_state is not None, BLOCK=block)
    if n:
        tiles = triton.cdiv(q, block_t)
        _chunk_scan_kernel[(n * tiles, num_heads, triton.cdiv(head_dim, block_p))](
            x, z if z is not None else x, B, C, D if D is not None else A, y, delta, lam, entering,
            chunks.chunk_start, chunks.chunk_end, num_heads, head_dim, dstate, num_heads // groups,
            *x.stride(), *(z if z is not None else x).stride(), *B.stride(), *C.stride(), *y.stride(),
            CHUNK=q, TILES=tiles, HAS_D=D is not None, HAS_Z=z is not None, IEEE=ieee,
            BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=block_n)
    return y

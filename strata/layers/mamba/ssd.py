"""Mamba2 SSD chunked scan over packed variable-length sequences (prefill), in plain torch.

Run `python -m strata.layers.mamba.ssd` to time it against the token-by-token recurrence.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

# Upper bound on elements of one [chunks, H, Q, Q] temporary; larger batches are processed in slices.
_MAX_INTRA_CHUNK_ELEMENTS = 1 << 25
# Log-decays below this are clamped: exp(-60) < 1e-26 is invisible in float32 sums.
_MIN_LOG_DECAY = -60.0


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (exact references in tests); everything else is computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """Delta = clamp(softplus(dt + dt_bias), *dt_limit), float32 (float64 for float64 dt).

    softplus is the identity above 20, as in the Mamba kernels.
    """
    delta = dt.to(compute_dtype(dt))
    if dt_bias is not None:
        delta = delta + dt_bias.to(delta.dtype)
    if dt_softplus:
        delta = F.softplus(delta, beta=1.0, threshold=20.0)
    low, high = dt_limit
    if low > 0.0 or high != math.inf:
        delta = delta.clamp(min=low, max=high)
    return delta


def heads_by_group(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Expand `[..., G, N]` to `[..., H, N]`: head h reads group h // (H // G)."""
    groups = t.shape[-2]
    return t.repeat_interleave(num_heads // groups, dim=-2) if groups != num_heads else t


def _chunk_layout(
    query_start_loc: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Row of each token once each sequence is padded to whole chunks; chunk count and first chunk per seq."""
    starts = query_start_loc[:-1].tolist()
    ends = query_start_loc[1:].tolist()
    lengths = [e - s for s, e in zip(starts, ends, strict=True)]
    num_chunks = [-(-n // chunk_size) for n in lengths]
    first_chunk = [0] * len(lengths)
    for i in range(1, len(lengths)):
        first_chunk[i] = first_chunk[i - 1] + num_chunks[i - 1]
    device = query_start_loc.device
    shifts = [f * chunk_size - s for f, s in zip(first_chunk, starts, strict=True)]
    shift = torch.tensor(shifts, device=device, dtype=torch.long)
    padded_rows = torch.arange(sum(lengths), device=device)
    padded_rows += shift.repeat_interleave(torch.tensor(lengths, device=device, dtype=torch.long))
    return padded_rows, num_chunks, first_chunk


# Internally a state is kept transposed and grouped, `[..., G, N, Hg*P]`, so that both the chunk end states
# (B^T @ (Delta x)) and the entering-state outputs (C @ S^T) are one matrix product per chunk and group.
def _transposed_states(states: torch.Tensor, groups: int) -> torch.Tensor:
    s, h, p, n = states.shape
    grouped = states.view(s, groups, h // groups, p, n).permute(0, 1, 4, 2, 3)
    return grouped.reshape(s, groups, n, h // groups * p)


def _plain_states(states_t: torch.Tensor, heads: int) -> torch.Tensor:
    s, g, n, hg_p = states_t.shape
    p = hg_p // (heads // g)
    return states_t.view(s, g, n, heads // g, p).permute(0, 1, 3, 4, 2).reshape(s, heads, p, n)


def _to_chunks(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    padded_rows: torch.Tensor,
    total_chunks: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-padded chunks: Delta*x `[n, H, Q, P]`, lam = cumsum of Delta*A `[n, Q, H]`, B and C `[n, G, Q, N]`.

    Padding with Delta = 0 and x = 0 keeps padded rows inert: decay exp(0) = 1 and no input.
    """
    dtype = compute_dtype(x)
    num_tokens, num_heads, head_dim = x.shape

    def chunked(t: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [n, Q, ...]; may alias t when nothing needs padding."""
        if total_chunks * chunk_size == num_tokens:
            return t.to(dtype).view(total_chunks, chunk_size, *t.shape[1:])
        out = t.new_zeros((total_chunks * chunk_size, *t.shape[1:]), dtype=dtype)
        out.index_copy_(0, padded_rows, t.to(dtype))
        return out.view(total_chunks, chunk_size, *t.shape[1:])

    delta_c = chunked(delta)
    dx = x.new_empty((total_chunks, num_heads, chunk_size, head_dim), dtype=dtype)  # head-major for matmuls
    torch.mul(chunked(x).transpose(1, 2), delta_c.transpose(1, 2)[..., None], out=dx)
    lam = torch.cumsum(delta_c * A.to(dtype), dim=1)
    bc, cc = (chunked(t).transpose(1, 2).contiguous() for t in (B, C))
    return dx, lam, bc, cc


def _intra_chunk(
    dx: torch.Tensor, lam: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk, with zero entering state: outputs `[n, H, Q, P]` and transposed end states.

    dx = Delta * x `[n, H, Q, P]`, lam (inclusive cumsum of Delta*A) `[n, Q, H]`, b and c `[n, G, Q, N]`.
    """
    n, h, q, p = dx.shape
    g = b.shape[1]
    lam_h = lam.transpose(1, 2)
    decay = lam_h[:, :, :, None] - lam_h[:, :, None, :]  # [n, H, t, s]
    # Delta*A <= 0, so the causal (lower) part is <= 0 and the clamp to 0 only defuses the upper part, which
    # could overflow; the causal mask is applied to the smaller C.B instead. Decays below exp(-60) add
    # nothing visible, and exp producing denormals is many times slower on CPU.
    decay.clamp_(min=_MIN_LOG_DECAY, max=0.0).exp_()
    cb = torch.matmul(c, b.transpose(2, 3)).tril_()  # [n, G, t, s]
    decay.view(n, g, h // g, q, q).mul_(cb[:, :, None])
    y = torch.matmul(decay, dx)

    to_end = torch.exp(lam[:, -1:] - lam)  # [n, Q, H]
    dxw = dx.new_empty((n, q, h, p))  # token-major, so that each group's heads form one matrix
    torch.mul(dx.transpose(1, 2), to_end[..., None], out=dxw)
    return y, torch.matmul(b.transpose(2, 3), dxw.view(n, q, g, h // g * p).transpose(1, 2))


def _chunk_decay(lam: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """exp(chunk total of Delta*A) from lam `[n, Q, H]`, laid out to broadcast against the transposed
    states `[chunks, G, N, Hg*P]`."""
    n, _, h = lam.shape
    decay = torch.exp(lam[:, -1]).view(n, groups, 1, h // groups, 1)
    return decay.expand(-1, -1, -1, -1, head_dim).flatten(3)


def _pass_states(
    local_states: torch.Tensor,
    chunk_decay: torch.Tensor,
    initial: torch.Tensor,
    num_chunks: list[int],
    first_chunk: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the inter-chunk recurrence of all sequences side by side, one step per chunk position.

    local_states `[chunks, ...]` and initial `[S, ...]` (same trailing shape), chunk_decay broadcastable to
    a chunk's state = exp(sum of Delta*A over the chunk). Returns (entering state of every chunk, final
    state of every sequence).
    """
    state = initial.clone()
    entering = torch.empty_like(local_states)
    device = local_states.device
    for j in range(max(num_chunks, default=0)):
        active = [i for i, n in enumerate(num_chunks) if n > j]
        chunk_ids = torch.tensor([first_chunk[i] + j for i in active], device=device)
        seq_ids = None if len(active) == len(num_chunks) else torch.tensor(active, device=device)
        current = state if seq_ids is None else state.index_select(0, seq_ids)
        entering.index_copy_(0, chunk_ids, current)
        updated = local_states.index_select(0, chunk_ids)
        updated.addcmul_(current, chunk_decay.index_select(0, chunk_ids))
        if seq_ids is None:
            state = updated
        else:
            state.index_copy_(0, seq_ids, updated)
    return entering, state


def _combine_outputs(
    y_intra: torch.Tensor, entering: torch.Tensor, c: torch.Tensor, lam: torch.Tensor
) -> torch.Tensor:
    """Token-major `[chunks*Q, H, P]` outputs: y_intra `[n, H, Q, P]` + exp(lam_t) * C_t @ S_in^T.

    entering `[n, G, N, Hg*P]` transposed entering states, c `[n, G, Q, N]`, lam `[n, Q, H]`.
    """
    n, h, q, p = y_intra.shape
    g = c.shape[1]
    # Accumulate into C @ S_in^T, which matmul already leaves token-major within each group: both updates
    # then write a contiguous tensor (reading y_intra transposed), far cheaper than a transposing addcmul.
    y = torch.matmul(c, entering).view(n, g, q, h // g, p)
    y.mul_(torch.exp(lam).view(n, q, g, h // g, 1).transpose(1, 2))
    y.add_(y_intra.view(n, g, h // g, q, p).transpose(2, 3))
    return y.transpose(1, 2).reshape(n * q, h, p)  # a view when there is one group


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    query_start_loc: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of packed sequences; equals the per-token recurrence of every sequence.

    x `[T, H, P]`, dt `[T, H]` (raw; Delta = clamp(softplus(dt + dt_bias), *dt_limit), must be >= 0),
    A `[H]` (<= 0), B and C `[T, G, N]` (head h uses group h // (H // G)), query_start_loc `[S+1]`
    cumulative offsets, initial_states `[S, H, P, N]` or None (zeros), D `[H]` skip, z `[T, H, P]` gate
    applied here as `y * silu(z)` after the D skip (PLaMo2's order; Mamba2 gates in a gated RMSNorm
    outside, so it passes z=None). Chunks never cross sequences; the result does not depend on chunk_size
    beyond rounding (on CPU 64 is fastest). Computes in float32 (float64 for float64 x).
    Returns (y `[T, H, P]` in x's dtype, final_states `[S, H, P, N]` in the compute dtype).
    """
    num_heads, head_dim = x.shape[1], x.shape[2]
    groups = B.shape[1]
    num_seqs = query_start_loc.numel() - 1
    dtype = compute_dtype(x)
    padded_rows, num_chunks, first_chunk = _chunk_layout(query_start_loc, chunk_size)
    total_chunks = sum(num_chunks)
    if total_chunks == 0:
        initial = x.new_zeros((num_seqs, num_heads, head_dim, B.shape[2]), dtype=dtype)
        return x.new_empty(x.shape), initial if initial_states is None else initial_states.to(dtype).clone()

    delta = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    dx, lam, bc, cc = _to_chunks(x, delta, A, B, C, padded_rows, total_chunks, chunk_size)
    step = max(1, _MAX_INTRA_CHUNK_ELEMENTS // (num_heads * chunk_size * chunk_size))
    parts = [
        _intra_chunk(dx[lo : lo + step], lam[lo : lo + step], bc[lo : lo + step], cc[lo : lo + step])
        for lo in range(0, total_chunks, step)
    ]
    y_chunks = torch.cat([y for y, _ in parts]) if len(parts) > 1 else parts[0][0]  # [chunks, H, Q, P]
    local_states = torch.cat([st for _, st in parts]) if len(parts) > 1 else parts[0][1]

    if initial_states is None:
        initial = local_states.new_zeros((num_seqs, *local_states.shape[1:]))
    else:
        initial = _transposed_states(initial_states.to(dtype), groups)
    chunk_decay = _chunk_decay(lam, groups, head_dim)
    entering, final_states = _pass_states(local_states, chunk_decay, initial, num_chunks, first_chunk)

    y = _combine_outputs(y_chunks, entering, cc, lam)
    if total_chunks * chunk_size != x.shape[0]:
        y = y.index_select(0, padded_rows)
    if D is not None:
        y.addcmul_(x.to(dtype), D.to(dtype)[:, None])
    if z is not None:
        y *= F.silu(z.to(dtype))
    return y.to(x.dtype), _plain_states(final_states, num_heads)


def _sequential_recurrence(
    x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline for the benchmark only: the plain per-token recurrence of one sequence."""
    num_tokens, num_heads, head_dim = x.shape
    b_heads, c_heads = heads_by_group(B, num_heads), heads_by_group(C, num_heads)
    decay = torch.exp(delta * A)
    state = x.new_zeros((num_heads, head_dim, B.shape[-1]))
    y = torch.empty_like(x)
    for t in range(num_tokens):
        inflow = (delta[t][:, None] * x[t])[..., None] * b_heads[t][:, None, :]
        state = state * decay[t][:, None, None] + inflow
        y[t] = torch.matmul(state, c_heads[t][:, :, None]).squeeze(-1)
    return y, state


def benchmark(
    num_tokens: int = 2048, heads: int = 8, head_dim: int = 64, dstate: int = 64, chunk_size: int = 64,
    repeats: int = 10,
) -> tuple[float, float]:
    """Best-of-`repeats` seconds for (chunked scan, sequential recurrence) on one random float32 sequence."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, heads, head_dim, generator=gen)
    dt = torch.randn(num_tokens, heads, generator=gen) - 1.0
    A = -torch.rand(heads, generator=gen) - 0.5
    B = torch.randn(num_tokens, 1, dstate, generator=gen)
    C = torch.randn(num_tokens, 1, dstate, generator=gen)
    qsl = torch.tensor([0, num_tokens])

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    chunked = best(lambda: ssd_chunk_scan_varlen(x, dt, A, B, C, chunk_size, qsl))
    delta = discretize_dt(dt, None, True, (0.0, math.inf))
    sequential = best(lambda: _sequential_recurrence(x, delta, A, B, C))
    return chunked, sequential


if __name__ == "__main__":
    for q in (64, 128, 256):
        chunked_s, sequential_s = benchmark(chunk_size=q)
        print(
            f"T=2048 H=8 P=64 N=64 Q={q}: chunked {chunked_s * 1e3:.1f} ms, "
            f"sequential {sequential_s * 1e3:.1f} ms, speed-up {sequential_s / chunked_s:.1f}x"
        )

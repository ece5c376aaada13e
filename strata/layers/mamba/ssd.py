"""Mamba2 SSD chunked scan over packed variable-length sequences (prefill), in plain torch.

Run `python -m strata.layers.mamba.ssd` to time it against the token-by-token recurrence.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Upper bound on elements of one [pairs, Q, Q] decay temporary of the exact fallback; more run in slices.
_MAX_DECAY_ELEMENTS = 1 << 24
# Log-decays below this are clamped: exp(-60) < 1e-26 is invisible in float32 sums.
_MIN_LOG_DECAY = -60.0
# A chunk's decays exp(lam_t - lam_s) are split as exp(lam_t - m) * exp(m - lam_s), m half the chunk's
# total, when that total stays within this: factors within exp(+-50) ~ 5e21 leave float32 sixteen orders
# of magnitude for C B^T x.
_MAX_SPLIT_LOG_DECAY = 100.0
# Below this share of (chunk, head) pairs that can be split, all take the exact path (measured break-even).
_MIN_SPLIT_SHARE = 0.5


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


@dataclass(frozen=True)
class _ChunkLayout:
    """Where each token goes once every sequence is cut into chunks of Q (the last one zero-padded).

    Chunk j of every sequence that has one must form one slice, so that the inter-chunk pass steps all
    sequences at once: when all sequences have the same number of chunks K they stay in order (chunk j
    of each is every K-th chunk from j), otherwise chunks are ordered by position, then by sequence,
    longest sequences first.
    """

    padded_rows: torch.Tensor  # [T] row of each token in the [chunks * Q] padded layout
    order: torch.Tensor  # [S] sequence ids in the order of each position's slice
    runs: list[range]  # per position j: the chunks at position j, of sequences order[0], order[1], ...
    total_chunks: int
    is_identity: bool  # padded layout == packed layout (all sequences whole chunks, in order)


def _chunk_layout(query_start_loc: torch.Tensor, chunk_size: int) -> _ChunkLayout:
    starts = query_start_loc[:-1].tolist()
    lengths = [end - start for start, end in zip(starts, query_start_loc[1:].tolist(), strict=True)]
    num_chunks = [-(-n // chunk_size) for n in lengths]
    total = sum(num_chunks)
    device = query_start_loc.device
    seq_of_token = torch.repeat_interleave(torch.tensor(lengths, device=device, dtype=torch.long))
    position = torch.arange(sum(lengths), device=device)
    position -= torch.tensor(starts, device=device, dtype=torch.long)[seq_of_token]
    if len(set(num_chunks)) == 1:
        per_seq = num_chunks[0]
        order = list(range(len(lengths)))
        runs = [range(j, total, per_seq) for j in range(per_seq)]
        chunk = seq_of_token * per_seq + position // chunk_size
    else:
        order = sorted(range(len(lengths)), key=lambda i: -num_chunks[i])
        rank = [0] * len(lengths)
        for r, i in enumerate(order):
            rank[i] = r
        runs, first = [], 0
        for j in range(max(num_chunks, default=0)):
            count = sum(1 for n in num_chunks if n > j)
            runs.append(range(first, first + count))
            first += count
        run_first = torch.tensor([run.start for run in runs] or [0], device=device, dtype=torch.long)
        chunk = run_first[position // chunk_size] + torch.tensor(rank, device=device, dtype=torch.long)[seq_of_token]
    padded_rows = chunk * chunk_size + position % chunk_size
    is_identity = len(set(num_chunks)) == 1 and total * chunk_size == sum(lengths)
    return _ChunkLayout(padded_rows, torch.tensor(order, device=device), runs, total, is_identity)


def _to_chunks(t: torch.Tensor, layout: _ChunkLayout, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, ...] -> zero-padded [chunks, Q, ...] in the compute dtype; may alias t."""
    if layout.is_identity:
        return t.to(dtype).view(layout.total_chunks, chunk_size, *t.shape[1:])
    out = t.new_zeros((layout.total_chunks * chunk_size, *t.shape[1:]), dtype=dtype)
    out.index_copy_(0, layout.padded_rows, t.to(dtype))
    return out.view(layout.total_chunks, chunk_size, *t.shape[1:])


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


def _per_head_columns(per_head: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """`[n, H]` -> `[n, G, 1, Hg*P]`, to scale the columns of transposed states head by head."""
    n, h = per_head.shape
    return per_head.view(n, groups, 1, h // groups, 1).expand(-1, -1, -1, -1, head_dim).reshape(n, groups, 1, -1)


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    # exp() landing in denormals is many times slower on CPU, and below exp(-60) adds nothing visible.
    return log_decay.clamp(min=_MIN_LOG_DECAY).exp_()


def _local_states(x: torch.Tensor, delta: torch.Tensor, lam: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each chunk's end state from a zero entering state, transposed: B^T @ (exp(lam_end - lam) Delta x).

    x `[n, Q, H, P]`, delta and lam (inclusive cumsum of Delta*A) `[n, Q, H]`, b `[n, G, Q, N]`.
    """
    n, q, h, p = x.shape
    g = b.shape[1]
    weight = _decay(lam[:, -1:] - lam).mul_(delta)
    weighted = torch.mul(x, weight[..., None]).view(n, q, g, h // g * p).transpose(1, 2)
    return torch.matmul(b.transpose(2, 3), weighted)


def _as_slice(chunks: range) -> slice:
    return slice(chunks.start, chunks.stop, chunks.step)


def _pass_states(
    local_states: torch.Tensor, chunk_decay: torch.Tensor, initial: torch.Tensor, layout: _ChunkLayout,
    entering_scale: torch.Tensor, entering: torch.Tensor,
) -> torch.Tensor:
    """Run the inter-chunk recurrence of all sequences side by side, one step per chunk position.

    local_states `[chunks, G, N, Hg*P]`, chunk_decay (exp of a chunk's total Delta*A) and entering_scale
    broadcastable to it, initial `[S, ...]` in sequence order. Writes every chunk's entering state times
    entering_scale into `entering` (a view into the operand of the output product) and returns every
    sequence's final state, in sequence order.
    """
    state = initial.index_select(0, layout.order)
    for run in layout.runs:
        # The first len(run) sequences (in layout.order) have a chunk at this position.
        chunks, count = _as_slice(run), len(run)
        torch.mul(state[:count], entering_scale[chunks], out=entering[chunks])
        torch.addcmul(local_states[chunks], chunk_decay[chunks], state[:count], out=state[:count])
    return state.index_select(0, torch.argsort(layout.order))


def _exact_intra(
    y: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, lam: torch.Tensor, cb: torch.Tensor,
    pairs: torch.Tensor,
) -> None:
    """Add the within-chunk term of the (chunk, head) pairs `[m, 2]` whose decay cannot be split to
    y `[n, Q, H, P]`, with the decay matrix itself: exp(lam_t - lam_s) * tril(C B^T)_ts @ (Delta x)_s."""
    n, q, h, p = x.shape
    heads_per_group = h // cb.shape[1]
    step = max(1, _MAX_DECAY_ELEMENTS // (q * q))
    offsets = torch.arange(q, device=x.device)
    for lo in range(0, pairs.shape[0], step):
        chunk, head = pairs[lo : lo + step].unbind(1)
        # Token row of each pair's tokens, and its row in the token-major [n * Q * H] layout: whole rows of
        # P gather fast, unlike a [chunk, :, head] index.
        tokens = (chunk[:, None] * q + offsets).flatten()
        heads = head.repeat_interleave(q)
        rows = tokens * h + heads
        lam_p = lam.view(-1).index_select(0, rows).view(-1, q)  # [m, Q]
        # The causal part is <= 0; the clamp to 0 only defuses the upper part, masked by tril(C B^T).
        decay = _decay((lam_p[:, :, None] - lam_p[:, None, :]).clamp_(max=0.0))
        decay.mul_(cb.flatten(0, 1).index_select(0, chunk * cb.shape[1] + head // heads_per_group))
        dx = x.view(n * q, h, p)[tokens, heads].view(-1, q, p)  # x may be a strided view of the input
        dx.mul_(delta.view(-1).index_select(0, rows).view(-1, q, 1))
        y.view(-1, p).index_add_(0, rows, torch.matmul(decay, dx).view(-1, p))


def _exact_intra_all(
    y: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, lam: torch.Tensor, cb: torch.Tensor
) -> None:
    """`_exact_intra` for every (chunk, head) pair, head-major instead of gathered, in slices of chunks."""
    n, q, h, p = x.shape
    g = cb.shape[1]
    step = max(1, _MAX_DECAY_ELEMENTS // (h * q * q))
    for lo in range(0, n, step):
        part = slice(lo, lo + step)
        lam_h = lam[part].transpose(1, 2).contiguous()  # [k, H, Q]
        decay = _decay((lam_h[..., :, None] - lam_h[..., None, :]).clamp_(max=0.0))  # [k, H, t, s]
        decay.view(-1, g, h // g, q, q).mul_(cb[part, :, None])
        dx = torch.mul(x[part], delta[part, ..., None]).transpose(1, 2)  # [k, H, Q, P]
        y[part] += torch.matmul(decay, dx).transpose(1, 2)


def _chunk_outputs(
    x: torch.Tensor, delta: torch.Tensor, lam: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    right: torch.Tensor, split: torch.Tensor, m: torch.Tensor,
) -> torch.Tensor:
    """All outputs `[n, Q, H, P]`: u_t * ([tril(C B^T) | C] @ [v Delta x ; exp(m) S_in^T])_t, where the
    within-chunk decay exp(lam_t - lam_s) = u_t * v_s = exp(lam_t - m) * exp(m - lam_s).

    Split this way the decay needs no per-head matrix: C B^T is shared by the heads of a group, so one
    product per chunk and group covers every head and the entering state at once. m is half the chunk's
    total log-decay (per head); where that total is too large for the split in floating point (`split`
    false, `[n, H]`), m = 0, v = 0, and that head's within-chunk term is computed with its decay matrix.
    m `[n, H]`; right `[n, G, Q + N, Hg*P]` arrives with its lower part (the scaled entering states) filled in.
    """
    n, q, h, p = x.shape
    g = b.shape[1]
    m = m[:, None]
    cb = torch.matmul(c, b.transpose(2, 3)).tril_()
    if bool(split.any()):
        inflow = torch.exp(m - lam).masked_fill_(~split[:, None], 0.0).mul_(delta)
        top = right[:, :, :q].view(n, g, q, h // g, p).transpose(1, 2)
        torch.mul(x.view(n, q, g, h // g, p), inflow.view(n, q, g, h // g, 1), out=top)
        y = torch.matmul(torch.cat([cb, c], dim=3), right)
    else:  # every head decays too fast within its chunks: only the entering states go through the product
        y = torch.matmul(c, right[:, :, q:])
    y = y.view(n, g, q, h // g, p)
    out = x.new_empty((n, q, g, h // g, p))
    torch.mul(y.transpose(1, 2), _decay(lam - m).view(n, q, g, h // g, 1), out=out)
    out = out.view(n, q, h, p)
    if not bool(split.any()):
        _exact_intra_all(out, x, delta, lam, cb)
    elif not bool(split.all()):
        _exact_intra(out, x, delta, lam, cb, (~split).nonzero())
    return out


def _splittable(lam: torch.Tensor) -> torch.Tensor:
    """`[n, H]`: which (chunk, head) pairs take the split-decay product."""
    split = lam[:, -1] >= -_MAX_SPLIT_LOG_DECAY
    if float(split.float().mean()) < _MIN_SPLIT_SHARE:
        split.zero_()  # the split product would be paid for all heads and serve few
    return split


def _split_point(lam: torch.Tensor, split: torch.Tensor) -> torch.Tensor:
    """m `[n, H]`: half of each chunk's total log-decay where it is split, else 0."""
    return torch.where(split, 0.5 * lam[:, -1], 0.0)


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
    groups, dstate = B.shape[1], B.shape[2]
    num_seqs = query_start_loc.numel() - 1
    dtype = compute_dtype(x)
    if initial_states is None:
        initial_states = x.new_zeros((num_seqs, num_heads, head_dim, dstate), dtype=dtype)
    layout = _chunk_layout(query_start_loc, chunk_size)
    n, q = layout.total_chunks, chunk_size
    if n == 0:
        return x.new_empty(x.shape), initial_states.to(dtype).clone()

    delta = _to_chunks(discretize_dt(dt, dt_bias, dt_softplus, dt_limit), layout, q, dtype)
    lam = torch.cumsum(delta * A.to(dtype), dim=1)  # [n, Q, H]
    x_c = _to_chunks(x, layout, q, dtype)
    b, c = (_to_chunks(t, layout, q, dtype).transpose(1, 2).contiguous() for t in (B, C))

    split = _splittable(lam)
    m = _split_point(lam, split)
    right = x.new_empty((n, groups, q + dstate, num_heads // groups * head_dim), dtype=dtype)
    final_states = _pass_states(
        _local_states(x_c, delta, lam, b),
        _per_head_columns(_decay(lam[:, -1]), groups, head_dim),
        _transposed_states(initial_states.to(dtype), groups), layout,
        _per_head_columns(torch.exp(m), groups, head_dim),
        right[:, :, q:],
    )
    y = _chunk_outputs(x_c, delta, lam, b, c, right, split, m)
    y = y.view(n * q, num_heads, head_dim)
    if not layout.is_identity:
        y = y.index_select(0, layout.padded_rows)
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
    from strata.host_memory import keep_freed_host_memory

    keep_freed_host_memory()  # as the engine does on CPU
    for q in (64, 128, 256):
        chunked_s, sequential_s = benchmark(chunk_size=q)
        print(
            f"T=2048 H=8 P=64 N=64 Q={q}: chunked {chunked_s * 1e3:.1f} ms, "
            f"sequential {sequential_s * 1e3:.1f} ms, speed-up {sequential_s / chunked_s:.1f}x"
        )

"""Paged attention in Triton: the KV-cache write, decode attention (split over long contexts) and varlen prefill
attention of all of a step's chunks in one launch, each beside the plain torch reference it must match. Both
attention kernels take a soft-cap (Gemma 2: scores become softcap * tanh(scores / softcap)) and per-head sinks
(gpt-oss: float32 [Hq], one more softmax logit per row whose weight is dropped).

Caches are [num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is block * block_size + offset.
On CPU the kernels run only under TRITON_INTERPRET=1 (set before triton is first imported); this module itself
imports triton lazily, so it loads without it.
"""
from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from strata.errors import ConfigError

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Split-K for decode: each split covers at least this many keys, and splits are added only while the grid
# (sequences x KV heads x splits) stays under _TARGET_PROGRAMS, i.e. when few sequences leave the GPU idle.
_MIN_KEYS_PER_SPLIT = 256
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 64


@functools.cache
def _kernels() -> ModuleType:
    try:
        from strata.kernels.triton import attention_kernels
    except ImportError as exc:
        raise ConfigError("Triton kernels need the `triton` package (pip install triton); without it use "
                          "kernels='torch'") from exc
    return attention_kernels


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("Triton kernels on CPU run only under the interpreter: set TRITON_INTERPRET=1 "
                          "before starting (or use kernels='torch')")
    if q.dtype not in _DTYPES or k_cache.dtype not in _DTYPES:
        raise TypeError(f"Triton attention takes float32, bfloat16 or float16, not {q.dtype} / {k_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have one shape [blocks, block_size, kv_heads, head_dim] "
                         "with a contiguous last dimension")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"cache block size must be a power of two, not {block_size}")


def _pad(n: int, least: int = 16) -> int:
    """tl.dot wants every dimension a power of two of at least 16."""
    return max(least, _next_power_of_2(n))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _emulated_bf16(t: torch.Tensor) -> bool:
    """Whether t is bfloat16 under the interpreter, which emulates bfloat16 badly (Triton 3.9): its tl.dot
    returns garbage and its casts from float32 truncate instead of rounding to nearest. Such tensors are
    multiplied in float32 and rounded by torch on the host, so that results match the GPU's and torch's."""
    return t.dtype == torch.bfloat16 and t.device.type == "cpu"


def _dot_f32(q: torch.Tensor) -> bool:
    # float32 always takes IEEE products (not tf32), so that GPU results match the CPU's.
    return q.dtype == torch.float32 or _emulated_bf16(q)


def _output(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=torch.float32 if _emulated_bf16(q) else q.dtype, device=q.device)


def _score_options(q: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None) -> dict:
    """The kernels' arguments for soft-capping and sinks: the cap in log2 units, sinks as contiguous float32 (or
    a stand-in pointer, never read, when there are none)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"sinks must have one value per query head ({q.shape[1]}), not shape {tuple(sinks.shape)}")
        sinks = sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
    return dict(sinks=q if sinks is None else sinks, cap_log2=(softcap or 1.0) * _LOG2E,
                CAPPED=softcap is not None, HAS_SINKS=sinks is not None)


def _tiles(q: torch.Tensor) -> tuple[int, int]:
    """(query rows, keys) per tile: GPU-sized on CUDA (halved in float32, whose tiles take twice the
    registers), small under the interpreter where small tiles keep tests on the paths that cross tiles."""
    if q.device.type != "cuda":
        return 16, 16
    return (32, 32) if q.dtype == torch.float32 else (64, 64)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatters k/v [T, Hkv, D] (any float dtype) into the caches at slot_mapping [T] (int32 or int64);
    a negative slot is padding and is skipped."""
    _check(k, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if _emulated_bf16(k_cache) and k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _kernels().write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, DIM_PAD=_next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1])


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.flatten(0, 1)[slots] = k[keep].to(k_cache.dtype)
    v_cache.flatten(0, 1)[slots] = v[keep].to(v_cache.dtype)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """Splits of each decode's context: enough to fill the GPU when there are few sequences, never below
    _MIN_KEYS_PER_SPLIT keys each; a power of two, so that few kernel variants are compiled."""
    by_work = max(1, max_context // _MIN_KEYS_PER_SPLIT)
    by_grid = max(1, _TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    splits = min(by_work, by_grid, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, first_keys: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, num_splits: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [S, Hq, D]; block_tables: [S, max_blocks] int32; sequence s attends keys first_keys[s] ..
    seq_lens[s] - 1 (int32), read in place from the caches. Returns [S, Hq, D] in q's dtype. Without
    num_splits it is chosen from the longest context the block tables can hold (no device sync)."""
    _check(q, k_cache, v_cache)
    options = _score_options(q, softcap, sinks)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = _output(q)
    if num_seqs == 0:
        return out.to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size)
    group, dim_pad = num_heads // num_kv_heads, _pad(head_dim)
    partial_shape = (num_seqs, num_heads, num_splits) if num_splits > 1 else (1,)
    m = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty((*partial_shape, dim_pad), dtype=torch.float32, device=q.device)
    kernels = _kernels()
    kernels.decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, first_keys, seq_lens, out, m, denom, acc, options["sinks"],
        scale * _LOG2E, options["cap_log2"], q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), GROUP=group, GROUP_PAD=_pad(group),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_N=_tiles(q)[1], NUM_SPLITS=num_splits,
        DOT_F32=_dot_f32(q), CAPPED=options["CAPPED"], HAS_SINKS=options["HAS_SINKS"])
    if num_splits > 1:
        kernels.combine_kernel[(num_seqs, num_heads)](
            m, denom, acc, options["sinks"], out, out.stride(0), out.stride(1), num_heads, HEAD_DIM=head_dim,
            DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=_next_power_of_2(num_splits),
            HAS_SINKS=options["HAS_SINKS"])
    return out.to(q.dtype)


def varlen_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             scale: float, sliding_window: int | None = None, chunk_size: int | None = None,
                             softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D], the packed queries of B chunks (query_start_loc [B + 1]); seq_lens [B]: each sequence's
    tokens in the cache after this step, its chunk's K/V included, so chunk b's queries sit at positions
    seq_lens[b] - len_b .. seq_lens[b] - 1 and attend causally (within the window / attention chunk) to keys
    read through block_tables [B, max_blocks]. Returns [T, Hq, D] in q's dtype."""
    _check(q, k_cache, v_cache)
    options = _score_options(q, softcap, sinks)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = _output(q)
    if num_tokens == 0:
        return out.to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_m, block_n = _tiles(q)
    _kernels().prefill_kernel[(num_tokens // block_m + num_seqs, num_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, options["sinks"], num_seqs,
        scale * _LOG2E, options["cap_log2"], q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DIM_PAD=_pad(head_dim), BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        SEQS_PAD=_next_power_of_2(num_seqs), WINDOW=sliding_window or 0, CHUNK=chunk_size or 0,
        DOT_F32=_dot_f32(q), CAPPED=options["CAPPED"], HAS_SINKS=options["HAS_SINKS"])
    return out.to(q.dtype)


def _gather_keys(cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of one sequence's keys (or values) at these positions, through its block table, as float64."""
    block_size = cache.shape[1]
    return cache[table.long()[positions // block_size], positions % block_size].double()


def _attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                      scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Q, Hq, D], k/v: [K, Hkv, D], visible: [Q, K] -> [Q, Hq, D] in float64, softmax in float64 (over the
    visible scores and the head's sink, whose column is dropped after)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
    weights = scores.softmax(dim=-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", weights, v)


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, first_keys: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float, softcap: float | None = None,
                                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(q)
    for s in range(q.shape[0]):
        positions = torch.arange(int(first_keys[s]), int(seq_lens[s]), device=q.device)
        k = _gather_keys(k_cache, block_tables[s], positions)
        v = _gather_keys(v_cache, block_tables[s], positions)
        visible = torch.ones(1, len(positions), dtype=torch.bool, device=q.device)
        out[s] = _attend_reference(q[s:s + 1], k, v, visible, scale, softcap, sinks)[0].to(q.dtype)
    return out


def varlen_prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                       block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                       seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                                       chunk_size: int | None = None, softcap: float | None = None,
                                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        start, end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        keys = torch.arange(seq_len, device=q.device)
        queries = keys[seq_len - (end - start):]
        visible = keys[None, :] <= queries[:, None]
        if sliding_window is not None:
            visible &= queries[:, None] - keys[None, :] < sliding_window
        if chunk_size is not None:
            visible &= keys[None, :] // chunk_size == queries[:, None] // chunk_size
        seen = visible.any(dim=0)  # keys no query sees may be gone from the cache (garbage)
        k = _gather_keys(k_cache, block_tables[b], keys[seen])
        v = _gather_keys(v_cache, block_tables[b], keys[seen])
        out[start:end] = _attend_reference(q[start:end], k, v, visible[:, seen], scale, softcap, sinks).to(q.dtype)
    return out


def benchmark(kind: str = "decode", num_seqs: int = 64, context_len: int = 4096, query_len: int = 512,
              num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
              dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> float:
    """Milliseconds per call (triton.testing.do_bench) of one decode step over num_seqs sequences of
    context_len keys, or one prefill of num_seqs chunks of query_len queries after context_len cached keys,
    with each sequence's blocks scattered over a shuffled cache."""
    import triton.testing

    seq_len = context_len + (1 if kind == "decode" else query_len)
    blocks_per_seq = -(-seq_len // block_size)
    tables = torch.randperm(num_seqs * blocks_per_seq, device=device).view(num_seqs, -1).to(torch.int32)
    cache_shape = (num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    if kind == "decode":
        q = torch.randn(num_seqs, num_heads, head_dim, device=device, dtype=dtype)
        first_keys = torch.zeros_like(seq_lens)
        run = lambda: paged_decode_attention(q, k_cache, v_cache, tables, first_keys, seq_lens, scale)  # noqa: E731
    elif kind == "prefill":
        q = torch.randn(num_seqs * query_len, num_heads, head_dim, device=device, dtype=dtype)
        starts = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * query_len
        run = lambda: varlen_prefill_attention(q, k_cache, v_cache, tables, starts, seq_lens, scale)  # noqa: E731
    else:
        raise ValueError(f"kind must be 'decode' or 'prefill', not {kind!r}")
    return triton.testing.do_bench(run)

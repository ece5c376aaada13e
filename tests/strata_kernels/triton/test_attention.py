"""Triton paged attention against its float64 torch references: on CPU under the interpreter (small shapes that
cover every option), and on CUDA at serving sizes (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from strata.errors import ConfigError
from strata.kernels.triton import attention as kernels

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _first_visible(position: int, window: int | None, chunk: int | None) -> int:
    first = 0 if window is None else max(0, position - window + 1)
    return first if chunk is None else max(first, position // chunk * chunk)


def _paged_cache(seq_lens: list[int], hidden_before: list[int], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str, seed: int = 0):
    """K/V caches holding each sequence in shuffled, non-contiguous blocks among unused ones. Everything a
    kernel must not read is NaN: unused blocks, the table's padding (it points at an unused block), slots past
    each sequence's end and its keys before hidden_before[s] (as if a sliding window had dropped them)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(blocks_per_seq) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    unused = int(ids[-1])
    tables = torch.full((len(seq_lens), max(blocks_per_seq)), unused, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    taken = 0
    for s, (n, hidden) in enumerate(zip(seq_lens, hidden_before, strict=True)):
        used = ids[2 * taken: 2 * taken + 2 * blocks_per_seq[s]: 2]  # every other id: holes between blocks
        taken += blocks_per_seq[s]
        tables[s, :len(used)] = used.to(torch.int32)
        positions = torch.arange(hidden, n)
        slots = used[positions // block_size] * block_size + positions % block_size
        k_cache.flatten(0, 1)[slots] = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache.flatten(0, 1)[slots] = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache.to(device), v_cache.to(device), tables.to(device)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[actual.dtype]
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _check_decode(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits=None, window=None,
                  chunk=None, device="cpu"):
    first_keys = [_first_visible(n - 1, window, chunk) for n in seq_lens]
    k_cache, v_cache, tables = _paged_cache(seq_lens, first_keys, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    firsts = torch.tensor(first_keys, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, firsts, lens, scale, num_splits=num_splits)
    expected = kernels.paged_decode_attention_reference(q, k_cache, v_cache, tables, firsts, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    _assert_close(out, expected)


def _check_prefill(query_lens, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, window=None,
                   chunk=None, device="cpu"):
    seq_lens = [c + n for c, n in zip(contexts, query_lens, strict=True)]
    hidden = [_first_visible(c, window, chunk) for c in contexts]
    k_cache, v_cache, tables = _paged_cache(seq_lens, hidden, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(device, dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(device, torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = kernels.varlen_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, window, chunk)
    expected = kernels.varlen_prefill_attention_reference(q, k_cache, v_cache, tables, starts, lens, scale,
                                                          window, chunk)
    assert out.dtype == q.dtype and out.shape == q.shape
    _assert_close(out, expected)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_write_kv_scatters_tokens_into_their_slots_in_the_cache_dtype(slot_dtype, dtype, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 6, 3, 8, generator=gen).to(dtype).unbind(0)
    slots = torch.randperm(5 * 4, generator=gen)[:6].to(slot_dtype)
    slots[2] = -1  # padding: written nowhere
    before = torch.randn(2, 5, 4, 3, 8, generator=gen).to(cache_dtype)
    caches, expected = before.clone(), before.clone()
    kernels.write_kv(k, v, caches[0], caches[1], slots)
    kernels.write_kv_reference(k, v, expected[0], expected[1], slots)
    assert torch.equal(caches, expected)
    changed = (caches != before).flatten(1, 2).flatten(2).any(-1).any(0)  # per slot
    assert changed.nonzero().flatten().tolist() == sorted(slots[slots >= 0].tolist())


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,num_splits", [
    (2, 2, 16, 4, 1),   # one query head per KV head, no split
    (4, 2, 8, 8, 3),    # GQA 2, tiny head, more splits than some sequences have key tiles
    (8, 2, 32, 16, None),  # GQA 4, split count chosen from the context
])
def test_decode_matches_reference_in_float32(num_heads, num_kv_heads, head_dim, block_size, num_splits):
    _check_decode([1, 13, 300], num_heads, num_kv_heads, head_dim, block_size, torch.float32, num_splits)


@pytest.mark.parametrize("window,chunk,num_splits", [(7, None, 1), (None, 16, 2), (40, 32, 4)])
def test_decode_sees_only_its_window_and_attention_chunk(window, chunk, num_splits):
    _check_decode([3, 45, 130], 4, 2, 16, 4, torch.float32, num_splits, window, chunk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_in_half_precision_accumulates_in_float32(dtype):
    _check_decode([5, 70], 4, 2, 16, 8, dtype, num_splits=2)


def test_default_num_splits_grows_with_context_and_shrinks_with_the_batch():
    assert kernels.default_num_splits(1, 8, 100) == 1
    assert kernels.default_num_splits(1, 8, 8192) == 32
    assert kernels.default_num_splits(256, 8, 8192) == 1
    assert kernels.default_num_splits(4, 8, 4096) == 16


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(2, 2, 16, 4), (4, 2, 8, 8),
                                                                        (4, 1, 32, 16)])
def test_prefill_mixes_first_and_continued_chunks_of_any_length(num_heads, num_kv_heads, head_dim, block_size):
    # first chunks (context 0) of 1 and 20 queries, continued chunks of 1, 5 and 17 queries
    _check_prefill([1, 5, 20, 1, 17], [0, 9, 0, 30, 200], num_heads, num_kv_heads, head_dim, block_size,
                   torch.float32)


@pytest.mark.parametrize("window,chunk", [(6, None), (None, 8), (24, 16)])
def test_prefill_sees_only_its_window_and_attention_chunk(window, chunk):
    _check_prefill([19, 4, 1], [0, 37, 90], 4, 2, 16, 4, torch.float32, window, chunk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_in_half_precision_accumulates_in_float32(dtype):
    _check_prefill([17, 3], [0, 40], 4, 2, 16, 8, dtype, window=20)


def test_kernels_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(2, 4, 2, 8)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        kernels.paged_decode_attention(q, cache, cache, lens[None], lens - 1, lens, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window,chunk", [(None, None), (1024, None), (None, 2048)])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.gpu
@cuda_only
def test_kernels_match_reference_on_cuda(kind, window, chunk, head_dim, dtype):
    if kind == "decode":
        _check_decode([1, 700, 3000, 5000], 32, 8, head_dim, 16, dtype, None, window, chunk, device="cuda")
    else:
        _check_prefill([1, 300, 1000, 77], [0, 0, 2500, 4000], 32, 8, head_dim, 16, dtype, window, chunk,
                       device="cuda")


@pytest.mark.gpu
@cuda_only
def test_write_kv_on_cuda_matches_reference():
    k, v = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
    slots = torch.randperm(1024 * 16, device="cuda")[:512]
    caches = torch.zeros(2, 1024, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    expected = caches.clone()
    kernels.write_kv(k, v, caches[0], caches[1], slots)
    kernels.write_kv_reference(k, v, expected[0], expected[1], slots)
    assert torch.equal(caches, expected)


def reference_rows(q, k_cache, v_cache, table, query_positions, first_key, scale, window, softcap, sinks):
    """float64, written per query row: the row's visible keys listed one by one through the block table, scores
    soft-capped, the head's sink appended as one more logit, softmax, the sink's weight dropped."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, position in enumerate(query_positions):
        keys = [t for t in range(first_key, position + 1) if window is None or position - t < window]
        slots = [int(table[t // block_size]) * block_size + t % block_size for t in keys]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [K, Hq, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[row].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1)[:, : len(keys)], v)
    return out


# Sinks spread around the scores' range: some heads give most of a row's weight to the sink.
SINKS = torch.tensor([-3.0, 0.5, 2.0, 6.0])
SCORE_CASES = [(2.0, None), (None, SINKS), (2.0, SINKS)]


@pytest.mark.parametrize("softcap,sinks", SCORE_CASES, ids=["cap", "sinks", "both"])
@pytest.mark.parametrize("num_kv_heads,window,num_splits", [(4, None, 1), (2, None, 3), (2, 7, 1), (1, 20, 2)])
def test_decode_applies_soft_caps_and_sinks(softcap, sinks, num_kv_heads, window, num_splits):
    seq_lens = [1, 13, 70]
    first_keys = [_first_visible(n - 1, window, None) for n in seq_lens]
    k_cache, v_cache, tables = _paged_cache(seq_lens, first_keys, 4, num_kv_heads, 16, torch.float32, "cpu")
    q = 3 * torch.randn(len(seq_lens), 4, 16, generator=torch.Generator().manual_seed(1))  # scores past the cap
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(first_keys, dtype=torch.int32),
                                         lens, 0.25, num_splits=num_splits, softcap=softcap, sinks=sinks)
    expected = torch.cat([reference_rows(q[s:s + 1], k_cache, v_cache, tables[s], [n - 1], first_keys[s], 0.25,
                                         window, softcap, sinks) for s, n in enumerate(seq_lens)])
    _assert_close(out, expected)


@pytest.mark.parametrize("softcap,sinks", SCORE_CASES, ids=["cap", "sinks", "both"])
@pytest.mark.parametrize("num_kv_heads,window", [(4, None), (2, None), (1, 6)])
def test_prefill_applies_soft_caps_and_sinks_with_cached_context(softcap, sinks, num_kv_heads, window):
    query_lens, contexts = [19, 5, 1], [0, 37, 12]  # a first chunk and two continued ones
    seq_lens = [c + n for c, n in zip(contexts, query_lens, strict=True)]
    hidden = [_first_visible(c, window, None) for c in contexts]
    k_cache, v_cache, tables = _paged_cache(seq_lens, hidden, 4, num_kv_heads, 16, torch.float32, "cpu")
    q = 3 * torch.randn(sum(query_lens), 4, 16, generator=torch.Generator().manual_seed(1))
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = kernels.varlen_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, window, None,
                                           softcap=softcap, sinks=sinks)
    expected = torch.cat([reference_rows(q[int(starts[b]):int(starts[b + 1])], k_cache, v_cache, tables[b],
                                         range(contexts[b], seq_lens[b]), 0, 0.25, window, softcap, sinks)
                          for b in range(len(seq_lens))])
    _assert_close(out, expected)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_half_precision_kernels_apply_soft_caps_and_sinks(kind):
    sinks = SINKS.bfloat16()  # a model cast whole to bfloat16: the kernels read the sinks as float32
    if kind == "decode":
        seq_lens, first_keys = [5, 70], [0, 0]
        k_cache, v_cache, tables = _paged_cache(seq_lens, first_keys, 8, 2, 16, torch.bfloat16, "cpu")
        q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
        lens, firsts = torch.tensor(seq_lens, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, firsts, lens, 0.25, num_splits=2,
                                             softcap=1.0, sinks=sinks)
        expected = kernels.paged_decode_attention_reference(q, k_cache, v_cache, tables, firsts, lens, 0.25, 1.0, sinks)
    else:
        k_cache, v_cache, tables = _paged_cache([57], [0], 8, 2, 16, torch.bfloat16, "cpu")
        q = torch.randn(17, 4, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
        starts, lens = torch.tensor([0, 17], dtype=torch.int32), torch.tensor([57], dtype=torch.int32)
        out = kernels.varlen_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, softcap=1.0,
                                               sinks=sinks)
        expected = kernels.varlen_prefill_attention_reference(q, k_cache, v_cache, tables, starts, lens, 0.25,
                                                              softcap=1.0, sinks=sinks)
    _assert_close(out, expected)

"""The CPU decode-attention kernel reads the paged cache in place and equals attention over the gathered context."""
from __future__ import annotations

import pytest
import torch

from strata.kernels.cpu import attention as cpu_attention
from strata.layers.attention import Attention, AttentionMetadata, PrefillChunk

pytestmark = pytest.mark.skipif(cpu_attention.decode_library() is None, reason="no C compiler to build the kernel")


def reference(q, k_cache, v_cache, tables, seq_lens, scale, window=None, chunk=None, softcap=None, sinks=None):
    """Each sequence on its own in float64: its keys listed block by block, softmax, weighted values. `softcap`
    bends the scores (cap * tanh(s / cap)); `sinks` [Hq] join each head's softmax as one more logit, dropped after."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    outs = []
    for s, length in enumerate(seq_lens.tolist()):
        slots = torch.tensor([int(tables[s, t // block_size]) * block_size + t % block_size for t in range(length)])
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        pos = torch.arange(length)
        visible = torch.ones(length, dtype=torch.bool)
        if window is not None:
            visible &= length - 1 - pos < window
        if chunk is not None:
            visible &= pos // chunk == (length - 1) // chunk
        scores = torch.einsum("hd,lhd->hl", q[s].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        weights = scores.softmax(-1)[:, :length]
        outs.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(outs).float()


def random_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 3
    # Blocks handed out in a shuffled order, as a long-running pool does.
    order = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * max_blocks]
    tables = order.view(len(seq_lens), max_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim", [32, 256, 24, 272])  # AVX-512's 16-token tiles (multiples of 16 to 256), or not
def test_kernel_equals_attention_over_the_listed_keys(num_heads, num_kv_heads, block_size, head_dim):
    seq_lens = [1, 7, 16, 17, 40, 3]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], block_size)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(None, None), 0.3)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, 0.3), atol=1e-5, rtol=1e-5)


@pytest.fixture
def avx2_build(x86_64_v3):
    """The kernels built for x86-64-v3 inside the test: their 8-token loops."""
    x86_64_v3(cpu_attention.decode_library, cpu_attention.prefill_library)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_build_equals_attention_over_the_listed_keys(avx2_build, dtype):
    """AVX2's loops: 8-token tiles (a partial last one), values in passes of 64 dimensions (72: a pass of 8 sums
    and one of 1), heads of 24 and 128; 20 and 144 take the plain loops."""
    seq_lens = [1, 7, 8, 9, 40, 3]
    for head_dim in (24, 64, 72, 128, 20, 144):
        q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 2, head_dim, 5, seed=head_dim)
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 5)
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)  # bfloat16: a cache under float32 queries
        out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(None, None), 0.3)
        expected = reference(q, k_cache, v_cache, tables, lens, 0.3)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=lambda e, d=head_dim: f"{d}: {e}")
        q, k_cache, v_cache, tables, lens = _verification_step([(30, 6), (9, 3)], 6, 2, head_dim, head_dim)
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(lens), tables, lens, [], 16)
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)  # a verification step's rows read keys together
        out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(None, None), 0.3)
        torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,chunk", [(5, None), (None, 8), (12, 8)])
def test_kernel_honours_sliding_windows_and_attention_chunks(window, chunk):
    seq_lens = [1, 5, 6, 9, 16, 33]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 4, 2, 16, 4, seed=1)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 4)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(window, chunk), 0.25)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.25, window, chunk)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# The gather path reads only the blocks a window or attention chunk can see: 3 of 5 with window 10.
@pytest.mark.parametrize("window,chunk", [(10, None), (None, 16), (10, 16), (None, None)])
def test_attention_layer_decode_matches_the_gather_path(window, chunk):
    seq_lens = [3, 20, 31, 40]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 4, 16, 8, seed=2)
    layer = Attention(8, 4, 16, scale=0.25, sliding_window=window, chunk_size=chunk)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 8)
    assert cpu_attention.available(q, k_cache)
    gathered = layer._decode_gathered(q, meta)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.25, window, chunk)
    torch.testing.assert_close(gathered, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer._decode(q, meta), gathered, atol=1e-5, rtol=1e-5)
    if window == 10:
        assert meta.decode_context(window, chunk)[0].shape == (4, 3)


def test_bfloat16_kernel_computes_in_float32_from_bfloat16_values():
    seq_lens = [1, 9, 40]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 2, 64, 16, seed=3)
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 16)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(None, None), 0.125)
    assert out.dtype == torch.bfloat16
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125)  # float64 math on the bfloat16 values
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("head_dim", [64, 24])  # AVX-512's tiles, and the portable loops
def test_a_bfloat16_cache_read_by_float32_queries_gives_float32_outputs_of_its_values(head_dim):
    """kv_cache_dtype=bfloat16 under a float32 model: q and the output stay float32, the math is float32's."""
    seq_lens = [1, 9, 40]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 2, head_dim, 16, seed=6)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    assert cpu_attention.available(q, k_cache) and not cpu_attention.available(q.bfloat16(), k_cache.float())
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 16)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(None, None), 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, 0.125), atol=1e-5, rtol=1e-5)


def test_a_float32_decode_step_writes_its_keys_rounded_into_a_bfloat16_cache():
    seq_lens = [4, 17, 33]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 2, 16, 8, seed=7)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    qkv = torch.randn(len(seq_lens), (8 + 2 + 2) * 16, generator=torch.Generator().manual_seed(8))
    k, v = qkv[:, 128:160].view(-1, 2, 16), qkv[:, 160:].view(-1, 2, 16)
    slots = torch.tensor([int(tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8 for i, n in enumerate(seq_lens)])
    layer = Attention(8, 2, 16, scale=0.25)
    layer.k_cache, layer.v_cache = k_cache.clone(), v_cache.clone()
    fused = layer(q, k, v, AttentionMetadata(slots, len(seq_lens), tables, lens, [], 8))
    k_cache.view(-1, 2, 16)[slots], v_cache.view(-1, 2, 16)[slots] = k.bfloat16(), v.bfloat16()  # torch's rounding
    assert torch.equal(layer.k_cache, k_cache) and torch.equal(layer.v_cache, v_cache)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.25).reshape(len(seq_lens), -1)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


def test_float16_caches_use_the_gather_path():
    q = torch.zeros(1, 2, 8, dtype=torch.float16)
    assert not cpu_attention.available(q, torch.zeros(1, 4, 2, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_writes_its_keys_and_reads_the_cache_in_one_call(dtype):
    seq_lens = [4, 17, 33]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 2, 16, 8, seed=4)
    q, k_cache, v_cache = (t.to(dtype) for t in (q, k_cache, v_cache))
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(len(seq_lens), (8 + 2 + 2) * 16, generator=g).to(dtype)  # k and v as views into one row
    k, v = qkv[:, 128:160].view(-1, 2, 16), qkv[:, 160:].view(-1, 2, 16)
    slots = torch.tensor([int(tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8 for i, n in enumerate(seq_lens)])
    meta = AttentionMetadata(slots, len(seq_lens), tables, lens, [], 8)
    layer = Attention(8, 2, 16, scale=0.25)
    layer.k_cache, layer.v_cache = k_cache.clone(), v_cache.clone()
    assert cpu_attention.rows_serve(k, v, slots)
    fused = layer(q, k, v, meta)
    k_cache.view(-1, 2, 16)[slots], v_cache.view(-1, 2, 16)[slots] = k, v
    assert torch.equal(layer.k_cache, k_cache) and torch.equal(layer.v_cache, v_cache)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.25).reshape(len(seq_lens), -1)  # float64 math
    if dtype == torch.bfloat16:
        torch.testing.assert_close(fused.float(), expected.bfloat16().float(), atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


# Per-head sinks around the scores' range: some heads give most of a row's weight to the sink.
SINKS = torch.tensor([-3.0, 0.0, 2.5, 1.0, 4.0, -1.0, 0.5, 6.0])
SCORE_CASES = [(1.5, None), (None, SINKS), (1.5, SINKS)]


@pytest.mark.parametrize("softcap,sinks", SCORE_CASES, ids=["cap", "sinks", "both"])
@pytest.mark.parametrize("num_kv_heads,window", [(8, None), (2, None), (2, 6), (1, 13)])
def test_kernel_applies_soft_caps_and_sinks(softcap, sinks, num_kv_heads, window):
    seq_lens = [1, 6, 17, 40]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, num_kv_heads, 16, 5, seed=6)
    q = q * 4  # scores well past the cap, so that capping matters
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 5)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(window, None), 0.25,
                                               softcap=softcap, sinks=sinks)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.25, window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_kernel_applies_soft_caps_and_sinks():
    seq_lens = [3, 29]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 2, 64, 16, seed=7)
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 16)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(None, None), 0.125,
                                               softcap=1.0, sinks=SINKS.bfloat16())  # sinks cast to float32
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125, softcap=1.0, sinks=SINKS)
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), atol=1e-3, rtol=2 ** -7)


@pytest.mark.parametrize("softcap,sinks", SCORE_CASES, ids=["cap", "sinks", "both"])
def test_capped_and_sink_layers_decode_through_the_kernel_as_the_gather_path(softcap, sinks, monkeypatch):
    seq_lens = [4, 17, 33]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 8, 2, 16, 8, seed=8)
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(len(seq_lens), (8 + 2 + 2) * 16, generator=g)
    k, v = qkv[:, 128:160].view(-1, 2, 16), qkv[:, 160:].view(-1, 2, 16)
    slots = torch.tensor([int(tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8 for i, n in enumerate(seq_lens)])
    meta = AttentionMetadata(slots, len(seq_lens), tables, lens, [], 8)
    layer = Attention(8, 2, 16, scale=0.25, sliding_window=10, softcap=softcap, sinks=sinks)
    layer.k_cache, layer.v_cache = k_cache.clone(), v_cache.clone()
    calls = []
    kernel = cpu_attention.paged_decode_attention
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    fused = layer(q, k, v, meta)  # the decode step's write and read in one kernel call
    assert len(calls) == 1 and calls[0]["softcap"] == softcap and calls[0]["sinks"] is sinks
    k_cache.view(-1, 2, 16)[slots], v_cache.view(-1, 2, 16)[slots] = k, v
    expected = reference(q, k_cache, v_cache, tables, lens, 0.25, 10, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(fused, expected.reshape(len(seq_lens), -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer._decode_gathered(q, meta), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def four_threads():
    """Four threads whatever the machine has: few (sequence, KV head) items then leave threads for key slices."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16 cache"])
@pytest.mark.parametrize("seq_lens,num_kv_heads,head_dim,window", [
    ([1000], 1, 256, None),  # Gemma 3 270M's decode: one sequence, one KV head of 256 dimensions
    ([300, 700], 1, 64, None),
    ([900], 2, 48, 600),  # a sliding window: the slices cut the window's keys, not the context's
    ([300, 260], 3, 32, None)])  # six (sequence, KV head) items for four threads: two slices each
def test_key_slices_of_a_long_context_merge_to_attention_over_all_its_keys(four_threads, dtype, seq_lens,
                                                                          num_kv_heads, head_dim, window):
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, 4 * num_kv_heads, num_kv_heads, head_dim, 16, seed=11)
    sinks = torch.linspace(-2.0, 3.0, 4 * num_kv_heads)
    if dtype != "float32":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
        q = q.bfloat16() if dtype == "bfloat16" else q
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, [], 16)
    for softcap, with_sinks in [(None, False), (2.0, True)]:
        out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *meta.decode_key_ranges(window, None), 0.1,
                                                   softcap=softcap, sinks=sinks if with_sinks else None)
        expected = reference(q, k_cache, v_cache, tables, lens, 0.1, window, softcap=softcap,
                             sinks=sinks if with_sinks else None)
        if dtype == "bfloat16":
            torch.testing.assert_close(out.float(), expected.bfloat16().float(), atol=1e-3, rtol=2 ** -7)
        else:
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_block_zeroer_clears_exactly_the_given_blocks_of_every_cache():
    caches = [torch.full((6, 4, 2, 8), float("nan"), dtype=dtype) for dtype in (torch.float32,) * 3]
    zeroer = cpu_attention.BlockZeroer.create(caches)
    zeroer([0, 4, 2])
    for c in caches:
        assert (c[[0, 2, 4]] == 0).all() and c[[1, 3, 5]].isnan().all()
    bf16 = [torch.full((3, 4, 2, 8), float("nan"), dtype=torch.bfloat16)]
    cpu_attention.BlockZeroer.create(bf16)([1])
    assert (bf16[0][1] == 0).all() and bf16[0][[0, 2]].isnan().all()


def test_block_zeroer_refuses_caches_it_cannot_address_alike():
    assert cpu_attention.BlockZeroer.create([]) is None
    assert cpu_attention.BlockZeroer.create([torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 4)]) is None
    assert cpu_attention.BlockZeroer.create([torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8).bfloat16()]) is None
    assert cpu_attention.BlockZeroer.create([torch.zeros(4, 8, 2, 4).transpose(1, 2)]) is None


def causal_reference(q, keys, values, offset, scale):
    """float64: query r (position offset + r) attends keys 0 .. offset + r."""
    group = q.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(keys.shape[0])[None, :] <= torch.arange(offset, offset + q.shape[0])[:, None]
    weights = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v).float()


def head_multiple():
    multiple = cpu_attention.prefill_library() and cpu_attention.prefill_library().prefill_attention_head_multiple()
    if not multiple:
        pytest.skip("no prefill attention kernel in this build")
    return multiple


@pytest.mark.parametrize("queries,offset,heads,kv_heads,dims", [
    (7, 0, 4, 2, 1), (300, 0, 8, 2, 1), (100, 150, 4, 4, 2), (1, 40, 2, 1, 1), (49, 0, 6, 3, 4)])
def test_causal_prefill_kernel_equals_attention_over_the_keys_each_query_sees(queries, offset, heads, kv_heads, dims):
    """Query blocks of 48 and key blocks of 128, partial ones, keys before the chunk (offset), grouped heads; scores
    spread wide (x4) so that the running maximum moves between key blocks."""
    head_dim = head_multiple() * dims
    g = torch.Generator().manual_seed(queries + offset)
    qkv = torch.randn(queries, (heads + 2 * kv_heads) * head_dim, generator=g) * 4
    q = qkv[:, : heads * head_dim].view(queries, heads, head_dim)  # rows a qkv output apart
    keys, values = (torch.randn(offset + queries, kv_heads, head_dim, generator=g) for _ in range(2))
    assert cpu_attention.prefill_serves(q, keys, values)
    out = cpu_attention.causal_prefill_attention(q, keys, values, 0.3, offset)
    torch.testing.assert_close(out, causal_reference(q, keys, values, offset, 0.3), atol=2e-5, rtol=1e-5)


def test_avx2_build_of_the_prefill_kernel_equals_the_reference(avx2_build):
    head_dim = head_multiple() * 2
    g = torch.Generator().manual_seed(1)
    q, keys, values = (torch.randn(130, 4, head_dim, generator=g) for _ in range(3))
    out = cpu_attention.causal_prefill_attention(q, keys[:, :2], values[:, :2], 0.2)
    torch.testing.assert_close(out, causal_reference(q, keys[:, :2], values[:, :2], 0, 0.2), atol=1e-5, rtol=1e-5)


def test_prefill_kernel_declines_what_it_does_not_read():
    head_dim = head_multiple()
    q, k = torch.randn(5, 2, head_dim), torch.randn(5, 1, head_dim)
    assert cpu_attention.prefill_serves(q, k, k)
    assert not cpu_attention.prefill_serves(q.bfloat16(), k.bfloat16(), k.bfloat16())
    assert not cpu_attention.prefill_serves(torch.randn(5, 2, head_dim + 8)[..., :head_dim], k, k)  # strided heads
    odd = torch.randn(5, 2, head_dim + 8)  # a head size the tiles do not divide
    assert not cpu_attention.prefill_serves(odd, odd[:, :1], odd[:, :1])
    with pytest.raises(ValueError, match="keys"):
        cpu_attention.causal_prefill_attention(q, k, k, 0.3, offset=2)


def test_attention_layer_prefill_after_cached_tokens_takes_the_kernel(monkeypatch):
    """A chunk of 30 tokens after 21 cached ones, keys of the chunk and before it read from the paged cache."""
    head_dim, block_size, num_computed, new = head_multiple() * 2, 4, 21, 30
    seq_len, g = num_computed + new, torch.Generator().manual_seed(5)
    layer = Attention(4, 2, head_dim, scale=0.25)
    layer.k_cache, layer.v_cache = (torch.zeros(16, block_size, 2, head_dim) for _ in range(2))
    slots = torch.randperm(16 * block_size, generator=g)[:seq_len]
    keys, values = (torch.randn(seq_len, 2, head_dim, generator=g) for _ in range(2))
    layer.k_cache.view(-1, 2, head_dim)[slots[:num_computed]] = keys[:num_computed]
    layer.v_cache.view(-1, 2, head_dim)[slots[:num_computed]] = values[:num_computed]
    q = torch.randn(new, 4, head_dim, generator=g)
    meta = AttentionMetadata(slots[num_computed:], 0, torch.zeros(0, 1, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), [PrefillChunk(0, new, num_computed, slots)], block_size)
    calls = []
    kernel = cpu_attention.causal_prefill_attention
    monkeypatch.setattr(cpu_attention, "causal_prefill_attention", lambda *a: calls.append(a[-1]) or kernel(*a))
    out = layer(q, keys[num_computed:], values[num_computed:], meta)
    assert calls == [num_computed]
    want = causal_reference(q, keys, values, num_computed, 0.25).flatten(1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def _verification_step(requests, num_heads, num_kv_heads, head_dim, seed):
    """A speculative verification step's rows: request i's `rows` consecutive positions ending at its `length`, each
    row its own query through the request's one block table (the rows of one request share it)."""
    q, k_cache, v_cache, tables, lens = random_batch([length for length, _ in requests], num_heads, num_kv_heads,
                                                     head_dim, 16, seed)
    row_tables, row_lens = [], []
    for i, (length, rows) in enumerate(requests):
        for r in range(rows):
            row_tables.append(tables[i])
            row_lens.append(length - rows + 1 + r)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(row_lens), num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, torch.stack(row_tables), torch.tensor(row_lens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16 cache"])
@pytest.mark.parametrize("requests,num_kv_heads,head_dim,window", [
    ([(300, 9)], 3, 64, None),  # SmolLM2's heads: 3 KV heads of 64, 9 rows; key slices on four threads
    ([(40, 5), (700, 9), (17, 1)], 2, 128, None),  # three requests, one a plain decode row among them
    ([(900, 6)], 1, 256, 600),  # Gemma 3's one KV head, a sliding window: each row's first key one later
    ([(130, 4), (250, 3)], 2, 24, None)])  # heads the vector loops do not take
def test_a_requests_rows_of_one_step_attend_their_own_keys_with_the_bits_of_their_decode_steps(
        four_threads, dtype, requests, num_kv_heads, head_dim, window):
    """A verification step's rows of one request read each key once for all of them (decode_attention_runs.h): each
    row equals attention over its own keys, and has the bits it has in a decode step of the same requests (one row
    each, as plain decoding would run them), with and without soft-capping and sinks."""
    q, k_cache, v_cache, tables, lens = _verification_step(requests, 3 * num_kv_heads, num_kv_heads, head_dim, 5)
    sinks = torch.linspace(-2.0, 3.0, 3 * num_kv_heads)
    if dtype != "float32":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
        q = q.bfloat16() if dtype == "bfloat16" else q
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(lens), tables, lens, [], 16)
    ranges = meta.decode_key_ranges(window, None)
    for softcap, with_sinks in [(None, False), (2.0, True)]:
        options = {"softcap": softcap, "sinks": sinks if with_sinks else None}
        together = cpu_attention.paged_decode_attention(q, k_cache, v_cache, *ranges, 0.1, **options)
        starts = [sum(rows for _, rows in requests[:i]) for i in range(len(requests))]
        for offset in range(max(rows for _, rows in requests)):  # a plain decode step: each request's row there
            rows = torch.tensor([start + min(offset, n - 1) for start, (_, n) in zip(starts, requests, strict=True)])
            decode = cpu_attention.paged_decode_attention(q[rows], k_cache, v_cache, *(r[rows] for r in ranges), 0.1,
                                                          **options)
            assert torch.equal(together[rows], decode), f"rows {rows.tolist()}"
        expected = reference(q, k_cache, v_cache, tables, lens, 0.1, window, **options)
        if dtype == "bfloat16":
            torch.testing.assert_close(together.float(), expected.bfloat16().float(), atol=1e-3, rtol=2 ** -7)
        else:
            torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)

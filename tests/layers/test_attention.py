"""Paged attention's prefill: windows and attention chunks read only the keys they can see, in query
blocks, with the result of attention over the whole context."""
from __future__ import annotations

import os

import pytest
import torch

from strata.layers import attention
from strata.layers.attention import Attention, AttentionMetadata, PrefillChunk


def reference(q, keys, values, first_position, scale, window, chunk, softcap=None, sinks=None):
    """float64, every key of the sequence, the visibility rule written out per (query, key) pair; `softcap` bends
    the scores (cap * tanh(s / cap)), `sinks` [Hq] add one logit per head to each row's softmax, dropped after."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    q_pos = torch.arange(first_position, first_position + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    if chunk is not None:
        visible &= k_pos // chunk == q_pos // chunk
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    weights = scores.softmax(-1)[..., : keys.shape[0]]
    return torch.einsum("hqk,khd->qhd", weights, v).flatten(1).float()


def run_prefill(window, chunk, num_computed, new_tokens, softcap=None, sinks=None, after_build=lambda: None):
    """One prefill chunk of a sequence whose first `num_computed` tokens are cached: (layer output, float64
    reference, metadata). `after_build` runs once the layer exists (a loader filling its parameters)."""
    block_size, kv_heads, heads, dim = 4, 2, 4, 8
    seq_len = num_computed + new_tokens
    g = torch.Generator().manual_seed(num_computed + new_tokens)
    num_blocks = -(-seq_len // block_size) + 2
    layer = Attention(heads, kv_heads, dim, scale=0.3, sliding_window=window, chunk_size=chunk, softcap=softcap,
                      sinks=sinks)
    after_build()
    layer.k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    layer.v_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    # Blocks in a shuffled order, the earlier tokens already in the cache.
    blocks = torch.randperm(num_blocks, generator=g)[: -(-seq_len // block_size)]
    positions = torch.arange(seq_len)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    keys, values = torch.randn(seq_len, kv_heads, dim, generator=g), torch.randn(seq_len, kv_heads, dim, generator=g)
    layer.k_cache.view(-1, kv_heads, dim)[slots[:num_computed]] = keys[:num_computed]
    layer.v_cache.view(-1, kv_heads, dim)[slots[:num_computed]] = values[:num_computed]
    q = torch.randn(new_tokens, heads, dim, generator=g)
    context = slots if num_computed else None
    meta = AttentionMetadata(slots[num_computed:], 0, torch.zeros(0, 1, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long),
                             [PrefillChunk(0, new_tokens, num_computed, context)], block_size)
    out = layer(q, keys[num_computed:], values[num_computed:], meta)
    return out, reference(q, keys, values, num_computed, 0.3, window, chunk, softcap, sinks), meta


@pytest.mark.parametrize("window,chunk", [(None, None), (6, None), (None, 8), (11, 8)])
@pytest.mark.parametrize("num_computed,new_tokens", [(0, 7), (0, 30), (3, 7), (21, 7), (40, 7), (13, 30)])
def test_prefill_equals_attention_over_the_whole_context(window, chunk, num_computed, new_tokens, monkeypatch):
    monkeypatch.setattr(attention, "_MIN_QUERY_BLOCK", 4)  # several query blocks at these sizes
    out, expected, meta = run_prefill(window, chunk, num_computed, new_tokens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if window is not None or chunk is not None:
        # Each block's keys start at one its first query sees (equality above: none visible was left out).
        for lo, hi, first, mask in meta.prefill_blocks(0, window, chunk):
            assert mask.shape == (hi - lo, hi - first) and bool(mask[0, 0])


# Sinks from -2 to 3: some heads give a row's weight mostly to the sink, others barely.
SINKS = torch.tensor([-2.0, 0.5, 3.0, 1.0])


@pytest.mark.parametrize("softcap,sinks", [(2.0, None), (None, SINKS), (2.0, SINKS)], ids=["cap", "sinks", "both"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_computed,new_tokens", [(0, 7), (13, 30)])
def test_soft_capped_and_sink_prefill_equals_the_reference(softcap, sinks, window, num_computed, new_tokens,
                                                           monkeypatch):
    monkeypatch.setattr(attention, "_MIN_QUERY_BLOCK", 4)
    out, expected, _ = run_prefill(window, None, num_computed, new_tokens, softcap, sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_sinks_are_read_at_each_forward_not_copied_at_construction(monkeypatch):
    """The loader fills the model's parameter after the layer is built: the layer must see the new values."""
    monkeypatch.setattr(attention, "_MIN_QUERY_BLOCK", 4)
    sinks = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    assert "sinks" not in dict(Attention(4, 2, 8, scale=0.3, sinks=sinks).named_parameters())  # the model owns it
    out, expected, _ = run_prefill(None, None, 13, 30, sinks=sinks, after_build=lambda: sinks.data.copy_(SINKS))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected, run_prefill(None, None, 13, 30)[1])  # the sinks changed the result


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_step_of_decodes_and_prefills_applies_caps_and_sinks_on_both_kernels(kernels):
    """One step (a decode of a 22-token sequence, then a 7-token prefill chunk after 9 cached tokens) of a windowed
    GQA layer with a cap and sinks: each sequence's rows equal the float64 reference, through the torch path (C
    decode kernel, explicit prefill) and the Triton kernels (the interpreter on CPU)."""
    if kernels == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    block_size, kv_heads, heads, dim, window, cap = 4, 2, 4, 16, 6, 2.0
    g = torch.Generator().manual_seed(3)
    lengths, new = [22, 16], [1, 7]
    tables = torch.tensor([[9, 2, 7, 0, 11, 4], [5, 1, 10, 3, 6, 6]])  # sequence 1 needs 4 blocks; padded
    keys = [torch.randn(n, kv_heads, dim, generator=g) for n in lengths]
    values = [torch.randn(n, kv_heads, dim, generator=g) for n in lengths]
    layer = Attention(heads, kv_heads, dim, scale=0.5, sliding_window=window, softcap=cap, sinks=SINKS)
    layer.k_cache = torch.zeros(12, block_size, kv_heads, dim)
    layer.v_cache = torch.zeros(12, block_size, kv_heads, dim)
    slots = [tables[s, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
             for s, n in enumerate(lengths)]
    for s in range(2):  # the cached tokens
        cached = lengths[s] - new[s]
        layer.k_cache.view(-1, kv_heads, dim)[slots[s][:cached]] = keys[s][:cached]
        layer.v_cache.view(-1, kv_heads, dim)[slots[s][:cached]] = values[s][:cached]
    q = 2 * torch.randn(sum(new), heads, dim, generator=g)
    step = lambda t: torch.cat([t[s][lengths[s] - new[s]:] for s in range(2)])  # noqa: E731
    meta = AttentionMetadata(step(slots), 1, tables[:1], torch.tensor(lengths[:1]), [PrefillChunk(1, 8, 9, slots[1])],
                             block_size, kernels=kernels, prefill_block_tables=tables[1:].to(torch.int32),
                             prefill_query_start=torch.tensor([0, 7], dtype=torch.int32),
                             prefill_seq_lens=torch.tensor(lengths[1:], dtype=torch.int32))
    out = layer(q, step(keys), step(values), meta)
    expected = torch.cat([reference(q[:1], keys[0], values[0], 21, 0.5, window, None, cap, SINKS),
                          reference(q[1:], keys[1], values[1], 9, 0.5, window, None, cap, SINKS)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

"""Paged attention's prefill: windows and attention chunks read only the keys they can see, in query
blocks, with the result of attention over the whole context."""
from __future__ import annotations

import pytest
import torch

from strata.layers import attention
from strata.layers.attention import Attention, AttentionMetadata, PrefillChunk


def reference(q, keys, values, first_position, scale, window, chunk):
    """float64, every key of the sequence, the visibility rule written out per (query, key) pair."""
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
    weights = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v).flatten(1).float()


@pytest.mark.parametrize("window,chunk", [(None, None), (6, None), (None, 8), (11, 8)])
@pytest.mark.parametrize("num_computed,new_tokens", [(0, 7), (0, 30), (3, 7), (21, 7), (40, 7), (13, 30)])
def test_prefill_equals_attention_over_the_whole_context(window, chunk, num_computed, new_tokens, monkeypatch):
    monkeypatch.setattr(attention, "_MIN_QUERY_BLOCK", 4)  # several query blocks at these sizes
    block_size, kv_heads, heads, dim = 4, 2, 4, 8
    seq_len = num_computed + new_tokens
    g = torch.Generator().manual_seed(num_computed + new_tokens)
    num_blocks = -(-seq_len // block_size) + 2
    layer = Attention(heads, kv_heads, dim, scale=0.3, sliding_window=window, chunk_size=chunk)
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
    expected = reference(q, keys, values, num_computed, 0.3, window, chunk)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if window is not None or chunk is not None:
        # Each block's keys start at one its first query sees (equality above: none visible was left out).
        for lo, hi, first, mask in meta.prefill_blocks(0, window, chunk):
            assert mask.shape == (hi - lo, hi - first) and bool(mask[0, 0])

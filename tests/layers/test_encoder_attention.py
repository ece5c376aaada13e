"""Encoder attention over packed sequences: the C kernel and the padded SDPA path against a float64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import attention as cpu_attention
from strata.layers import encoder_attention


def _head_multiple() -> int:
    library = cpu_attention.prefill_library()
    multiple = library.prefill_attention_head_multiple() if library is not None else 0
    if not multiple:
        pytest.skip("no prefill attention kernel in this build")
    return multiple


def _reference(q, k, v, lens, scale):
    """float64 per sequence: every query sees every key of its own sequence (grouped heads repeated)."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        rows = slice(start, start + n)
        keys, values = (t[rows].double().repeat_interleave(group, dim=1) for t in (k, v))
        weights = (torch.einsum("qhd,khd->hqk", q[rows].double(), keys) * scale).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, values))
        start += n
    return torch.cat(outs).float()


def _starts(lens):
    return F.pad(torch.cumsum(torch.tensor(lens), 0), (1, 0))


@pytest.mark.parametrize("lens,heads,kv_heads,dims", [
    ([1], 2, 2, 1), ([200, 129, 49, 48, 7, 1], 4, 4, 1), ([130, 3, 60], 6, 2, 2)])
def test_kernel_equals_bidirectional_attention_within_each_sequence(lens, heads, kv_heads, dims):
    """Query blocks of 48 and key blocks of 128, partial ones, sequences of one token, grouped heads; rows a qkv
    output apart; scores spread wide (x2) so that the running maximum moves between key blocks."""
    head_dim, tokens = _head_multiple() * dims, sum(lens)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 2
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    assert cpu_attention.prefill_serves(q, k, v)
    out = cpu_attention.varlen_bidirectional_attention(q, k, v, _starts(lens), 0.3)
    # float32 SDPA itself lands 2.6e-5 from the float64 reference on these scores (the kernel 1.9e-5).
    torch.testing.assert_close(out, _reference(q, k, v, lens, 0.3), atol=5e-5, rtol=1e-4)


def test_kernel_refuses_sequence_starts_that_do_not_cover_the_tokens():
    head_dim = _head_multiple()
    q = torch.randn(10, 2, head_dim)
    with pytest.raises(ValueError, match="seq_starts"):
        cpu_attention.varlen_bidirectional_attention(q, q, q, torch.tensor([0, 4, 9]), 0.3)


@pytest.mark.parametrize("kernel", [True, False])
def test_packed_attention_takes_the_kernel_or_pads_for_sdpa_alike(kernel, monkeypatch):
    head_dim, heads, lens = _head_multiple(), 3, [70, 5, 33]
    if not kernel:
        monkeypatch.setattr(cpu_attention, "prefill_serves", lambda *_: False)
    tokens, max_len = sum(lens), max(lens)
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=torch.Generator().manual_seed(3))
    q, k, v = qkv.split(heads * head_dim, dim=-1)
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pad_index = rows * max_len + torch.cat([torch.arange(n) for n in lens])
    key_mask = (torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None]).view(len(lens), 1, 1, max_len)
    out = encoder_attention.packed_attention(q, k, v, heads, _starts(lens), pad_index, key_mask, max_len)
    expected = _reference(*(t.view(tokens, heads, head_dim) for t in (q, k, v)), lens, head_dim ** -0.5)
    torch.testing.assert_close(out, expected.view(tokens, -1), atol=2e-5, rtol=1e-5)

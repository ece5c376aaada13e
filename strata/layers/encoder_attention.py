"""Bidirectional attention of an encoder's packed sequences (BERT's): each token sees every token of its own sequence.

On CPU the C kernel (strata.kernels.cpu.attention) reads the packed rows in place; padding every sequence to the
longest for SDPA (zeroed grids, scatters and a gather per layer) cost about three times the attention itself there.
Elsewhere (GPU, or a CPU without the kernel's build), SDPA runs on the padded grid with a key mask."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.cpu import attention as cpu_attention


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, seq_starts: torch.Tensor,
                     pad_index: torch.Tensor, key_mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """q / k / v [T, heads * d] (views of a qkv output serve); `seq_starts` [B + 1] int64 (sequence i is rows
    seq_starts[i] .. seq_starts[i + 1] - 1), `pad_index` [T] each row's place in a [B * max_len] grid, `key_mask`
    [B, 1, 1, max_len]. Returns [T, heads * d], softmax(q k^T / sqrt(d)) v within each sequence."""
    tokens, d = q.shape[0], q.shape[1] // heads
    q3, k3, v3 = q.view(tokens, heads, d), k.view(tokens, -1, d), v.view(tokens, -1, d)
    if cpu_attention.prefill_serves(q3, k3, v3):
        out = cpu_attention.varlen_bidirectional_attention(q3, k3, v3, seq_starts.cpu(), d ** -0.5)
        return out.view(tokens, heads * d)
    b = key_mask.shape[0]

    def padded(t: torch.Tensor) -> torch.Tensor:  # [T, heads * d] -> [B, heads, max_len, d]
        grid = t.new_zeros(b * max_len, t.shape[1])
        grid[pad_index] = t
        return grid.view(b, max_len, -1, d).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=key_mask)
    return out.transpose(1, 2).reshape(b * max_len, heads * d)[pad_index]

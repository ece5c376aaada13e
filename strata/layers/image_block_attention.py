"""Gemma 3's prefill attention among one image's tokens: bidirectional within the image, causal elsewhere.

The paged attention attends every row causally; then the rows of each image in a prefill chunk are attended
again over the keys up to the image's end (read back from the cache, which already holds the whole image: the
scheduler never ends a chunk inside one), and their outputs replaced. Decode rows are never image tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from strata.layers.attention import Attention, AttentionMetadata


@dataclass
class ImageBlock:
    """The rows of one image's tokens in a step, and every key its tokens may see (positions 0 .. image end)."""

    row_start: int
    row_end: int
    image_start: int  # position of the image's first token
    query_positions: torch.Tensor  # [Q]
    key_slots: torch.Tensor  # [image end] cache slot of each position
    _masks: dict = field(default_factory=dict)

    def keys(self, window: int | None) -> tuple[int, torch.Tensor]:
        """(first key position, [Q, keys] mask) for a layer with this sliding window: transformers' rule,
        (causal or same image) and inside the window."""
        if window not in self._masks:
            first = 0 if window is None else max(0, int(self.query_positions[0]) - window + 1)
            k_pos = torch.arange(first, self.key_slots.shape[0], device=self.key_slots.device)[None, :]
            q_pos = self.query_positions[:, None]
            mask = (k_pos <= q_pos) | (k_pos >= self.image_start)
            if window is not None:
                mask &= q_pos - k_pos < window
            self._masks[window] = (first, mask)
        return self._masks[window]


@dataclass
class ImageBlockMetadata(AttentionMetadata):
    """The step's attention metadata and its image blocks."""

    image_blocks: list[ImageBlock] = field(default_factory=list)

    @classmethod
    def of(cls, meta: AttentionMetadata, blocks: list[ImageBlock]) -> ImageBlockMetadata:
        return cls(**{f.name: getattr(meta, f.name) for f in fields(AttentionMetadata)}, image_blocks=blocks)


def _sequence_slots(meta: AttentionMetadata, index: int) -> torch.Tensor:
    """Cache slots of every position of prefill `index`'s sequence up to the end of its chunk."""
    p = meta.prefills[index]
    if p.context_slots is not None:
        return p.context_slots
    if meta.kernels == "triton":
        positions = torch.arange(p.seq_len, device=meta.slot_mapping.device)
        table = meta.prefill_block_tables[index]
        return table[positions // meta.block_size] * meta.block_size + positions % meta.block_size
    return meta.slot_mapping[p.query_start:p.query_end]  # nothing computed before: the chunk is the sequence


def image_blocks(meta: AttentionMetadata, image_spans: Sequence[Sequence[tuple[int, int]] | None]
                 ) -> list[ImageBlock]:
    """The image blocks of a step's prefill chunks; `image_spans[i]`: the (start, end) positions of each image's
    tokens in prefill i's sequence, or None."""
    blocks = []
    for i, (p, spans) in enumerate(zip(meta.prefills, image_spans, strict=True)):
        chunk_end = p.seq_len
        for start, end in spans or ():
            if start >= chunk_end or end <= p.num_computed:
                continue
            if end > chunk_end:
                raise RuntimeError(f"a prefill chunk ends at position {chunk_end} inside an image ({start}, {end}); "
                                   "the scheduler must keep an image's tokens in one chunk")
            first = max(start, p.num_computed)
            row = p.query_start + first - p.num_computed
            device = meta.slot_mapping.device
            blocks.append(ImageBlock(row, row + end - first, start, torch.arange(first, end, device=device),
                                     _sequence_slots(meta, i)[:end]))
    return blocks


class ImageBlockAttention(Attention):
    """Paged attention whose image rows, in steps with image blocks, see their whole image."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = super().forward(q, k, v, meta)
        if not isinstance(meta, ImageBlockMetadata) or not meta.image_blocks:
            return out
        if self.k_cache is None:
            raise RuntimeError("image blocks need the KV cache: their keys are read back from it")
        rows = out.view(q.shape[0], self.num_heads, self.head_dim)
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        for b in meta.image_blocks:
            first, mask = b.keys(self.sliding_window)
            slots = b.key_slots[first:]
            rows[b.row_start:b.row_end] = self._attend_rows(q[b.row_start:b.row_end], flat_k[slots].to(q.dtype),
                                                            flat_v[slots].to(q.dtype), mask)
        return out

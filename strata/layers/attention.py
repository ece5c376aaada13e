"""Paged attention: K/V are written into fixed-size blocks and read back through block tables.

The runner orders each step's sequences decodes first (one query token each), then prefill chunks.
With the Triton kernels (CUDA, or the CPU interpreter) decodes and prefill chunks are each one launch reading
the blocks in place. The plain-torch path attends decodes in one call (on CPU by a C kernel reading the
blocks in place, elsewhere by SDPA over their gathered blocks) and each prefill chunk on its own, straight
from this step's K/V when it has no earlier context (on CPU, float32 causal chunks by a C kernel).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from strata.errors import UnsupportedModelError
from strata.kernels.cpu import attention as cpu_attention
from strata.kernels.triton import attention as triton_attention

# Prefill chunks of windowed or chunked-attention layers are attended in query blocks of at least this
# many tokens (or the window / attention chunk, if longer), each over the keys it can see.
_MIN_QUERY_BLOCK = 256


@dataclass
class PrefillChunk:
    query_start: int
    query_end: int
    num_computed: int  # tokens of this sequence already in the cache before this step
    context_slots: torch.Tensor | None  # cache slots of all its tokens, when num_computed > 0

    @property
    def seq_len(self) -> int:
        return self.num_computed + self.query_end - self.query_start


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each token of this step
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # [num_decodes] context length including this step's token
    prefills: list[PrefillChunk]
    block_size: int
    kernels: str = "torch"  # "triton": every decode in one launch, every prefill chunk in another
    # Triton path: the prefill chunks' block tables, query offsets (from the first prefill token) and lengths
    # in the cache after this step.
    prefill_block_tables: torch.Tensor | None = None
    prefill_query_start: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)

    def decode_context(self, window: int | None, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables cut to the blocks each decode token can see, and the [num_decodes, 1, 1, L] mask
        over their keys: with a window or attention chunk, only those blocks are gathered."""
        key = ("decode", window, chunk)
        if key not in self._masks:
            tables, bs = self.decode_block_tables, self.block_size
            seq_lens = self.decode_seq_lens
            first_block = torch.zeros_like(seq_lens)
            span = min(s for s in (window, chunk, tables.shape[1] * bs) if s is not None)
            width = min(tables.shape[1], (span - 1) // bs + 2)  # blocks a span of keys can touch
            if width < tables.shape[1]:
                first_block = _first_visible_keys(seq_lens, window, chunk) // bs
                columns = (first_block[:, None] + torch.arange(width, device=tables.device))
                # Past a sequence's last block the columns repeat it; those keys lie beyond its
                # length and are masked.
                tables = tables.gather(1, columns.clamp_(max=tables.shape[1] - 1))
            keys = first_block[:, None] * bs + torch.arange(width * bs, device=seq_lens.device)
            mask = _allowed((seq_lens - 1).unsqueeze(1), keys, window, chunk)[:, None, None, :]
            self._masks[key] = (tables, mask)
        return self._masks[key]

    def decode_key_ranges(self, window: int | None, chunk: int | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int32 (block tables, first visible key, context length) of each decode, for the CPU kernel."""
        key = ("ranges", window, chunk)
        if key not in self._masks:
            seq_lens = self.decode_seq_lens
            if seq_lens.device.type == "cpu":  # through numpy: torch's small ops cost a decode step 0.15 ms here
                tables, lens = self.decode_block_tables.numpy(), seq_lens.numpy()
                ranges = (tables, _first_visible_keys(lens, window, chunk), lens)
                self._masks[key] = tuple(torch.from_numpy(a.astype(np.int32)) for a in ranges)
            else:
                first = _first_visible_keys(seq_lens, window, chunk)
                self._masks[key] = (self.decode_block_tables.to(torch.int32).contiguous(), first.to(torch.int32),
                                    seq_lens.to(torch.int32))
        return self._masks[key]

    def prefill_blocks(self, index: int, window: int | None, chunk: int | None
                       ) -> list[tuple[int, int, int, torch.Tensor]]:
        """Query blocks of prefill `index`: (first query, end, first key, [queries, keys] mask), as
        positions in the sequence; each block reads keys from the first one its first query may see up
        to its last query. With a window or attention chunk a late chunk of a long prompt attends to what
        it can see, not to the whole context, and a long chunk is not one dense [Q, Q] product."""
        key = ("prefill", index, window, chunk)
        if key not in self._masks:
            p = self.prefills[index]
            spans = [s for s in (window, chunk) if s is not None]
            step = max(min(spans), _MIN_QUERY_BLOCK) if spans else p.seq_len
            device = self.slot_mapping.device
            blocks = []
            for lo in range(p.num_computed, p.seq_len, step):
                hi = min(lo + step, p.seq_len)
                first = int(_first_visible_keys(torch.tensor(lo + 1), window, chunk))
                q_pos = torch.arange(lo, hi, device=device).unsqueeze(1)
                keys = torch.arange(first, hi, device=device).unsqueeze(0)
                blocks.append((lo, hi, first, _allowed(q_pos, keys, window, chunk)))
            self._masks[key] = blocks
        return self._masks[key]


def _first_visible_keys(seq_lens: torch.Tensor | np.ndarray, window: int | None, chunk: int | None
                        ) -> torch.Tensor | np.ndarray:
    """The first key the last token of each sequence (of these lengths) may see (a tensor or a numpy array)."""
    first = seq_lens * 0
    if window is not None:
        first = (seq_lens - window).clip(min=0)
    if chunk is not None:
        first = first.clip(min=(seq_lens - 1) // chunk * chunk)
    return first


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    if chunk is not None:
        ok &= (k_pos // chunk) == (q_pos // chunk)
    return ok


class Attention(nn.Module):
    """Multi-head attention over a paged cache of shape [num_blocks, block_size, kv_heads, head_dim].

    `softcap` (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask and softmax.
    `sinks` (gpt-oss): one logit per query head of this rank (float32 [num_heads]) joins every row's softmax and is
    dropped after, so a row may give part of its weight to nothing. The model owns the tensor (the loader fills it
    in place), so it is read at each forward, never copied. SDPA knows neither, so on the torch path such a layer
    attends through `_attend_explicit`; the C decode kernel and the Triton kernels apply both."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, chunk_size: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.chunk_size = scale, sliding_window, chunk_size
        self.softcap = softcap
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise UnsupportedModelError(f"attention sinks have shape {tuple(sinks.shape)}; expected one per query "
                                        f"head of this rank, ({num_heads},)")
        # Kept out of nn.Module's registry: the model registers (and loads) this parameter; a second name here
        # would put it twice in state_dict.
        self.__dict__["sinks"] = sinks
        self.k_cache: torch.Tensor | None = None  # bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]."""
        if self.k_cache is None:  # no cache bound (the pooling runner): whole prompts see this step's keys alone
            return self._forward_uncached(q, k, v, meta)
        if meta.kernels == "triton":
            return self._forward_triton(q, k, v, meta)
        if not meta.prefills and k.dtype == q.dtype and \
                cpu_attention.available(q, self.k_cache) and \
                cpu_attention.rows_serve(k, v, meta.slot_mapping):  # a decode step: write and read in one call
            tables, first_keys, seq_lens = meta.decode_key_ranges(self.sliding_window, self.chunk_size)
            out = cpu_attention.paged_decode_attention(q, self.k_cache, self.v_cache, tables, first_keys, seq_lens,
                                                       self.scale, new_kv=(k, v, meta.slot_mapping),
                                                       softcap=self.softcap, sinks=self.sinks)
            return out.view(q.shape[0], -1)
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        stored_k, stored_v = k.to(flat_k.dtype), v.to(flat_v.dtype)
        flat_k.index_copy_(0, meta.slot_mapping, stored_k)
        flat_v.index_copy_(0, meta.slot_mapping, stored_v)
        if stored_k.dtype != k.dtype:  # a narrower cache (kv_cache_dtype): a prompt sees its keys as later steps do
            k, v = stored_k.to(k.dtype), stored_v.to(v.dtype)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], meta)
        for i, p in enumerate(meta.prefills):
            out[p.query_start:p.query_end] = self._prefill(q, k, v, i, meta, flat_k, flat_v)
        return out.view(q.shape[0], -1)

    def _forward_uncached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                          ) -> torch.Tensor:
        """Each prefill is a whole sequence in this step (nothing computed before it): causal attention over its
        own rows, without writing a cache no later step reads."""
        if meta.num_decodes or any(p.num_computed or p.context_slots is not None for p in meta.prefills):
            raise ValueError("attention without a KV cache takes whole prompts only (no decodes, no earlier context)")
        out = torch.empty_like(q)
        for i, p in enumerate(meta.prefills):
            out[p.query_start:p.query_end] = self._prefill(q, k, v, i, meta, None, None)
        return out.view(q.shape[0], -1)

    def _forward_triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                        ) -> torch.Tensor:
        """The Triton kernels: K/V written to the cache, then every decode and every prefill chunk read
        through the block tables in place (a chunk's own keys too), one launch each."""
        triton_attention.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out, nd = torch.empty_like(q), meta.num_decodes
        if nd:
            tables, first_keys, seq_lens = meta.decode_key_ranges(self.sliding_window, self.chunk_size)
            out[:nd] = triton_attention.paged_decode_attention(q[:nd], self.k_cache, self.v_cache, tables,
                                                               first_keys, seq_lens, self.scale,
                                                               softcap=self.softcap, sinks=self.sinks)
        if meta.prefills:
            out[nd:] = triton_attention.varlen_prefill_attention(
                q[nd:], self.k_cache, self.v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_seq_lens, self.scale, self.sliding_window, self.chunk_size, self.softcap, self.sinks)
        return out.view(q.shape[0], -1)

    @property
    def plain(self) -> bool:
        """Neither soft-capping nor sinks: the scores' softmax is SDPA's."""
        return self.softcap is None and self.sinks is None

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool = False) -> torch.Tensor:
        """q: [B, Hq, Q, D], k/v: [B, Hkv, K, D]."""
        if not self.plain:
            return self._attend_explicit(q, k, v, mask, causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def _attend_explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         causal: bool) -> torch.Tensor:
        """`_attend` spelled out for what SDPA cannot express: the cap bends scores before the mask, and a sink
        is one more softmax column per head. The softmax runs in float32 whatever the activations' dtype, as
        Gemma's and gpt-oss's references do."""
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:  # the queries are the last Q of the K keys
            queries, keys = scores.shape[-2], scores.shape[-1]
            mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
        scores = scores.float()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
        sink = self.sinks.to(device=scores.device, dtype=torch.float32).view(1, -1, 1, 1)
        probs = torch.softmax(torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)
        return torch.matmul(probs[..., :-1].to(v.dtype), v)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if cpu_attention.available(q, self.k_cache):
            tables, first_keys, seq_lens = meta.decode_key_ranges(self.sliding_window, self.chunk_size)
            return cpu_attention.paged_decode_attention(q, self.k_cache, self.v_cache, tables, first_keys,
                                                        seq_lens, self.scale, softcap=self.softcap, sinks=self.sinks)
        return self._decode_gathered(q, meta)

    def _decode_gathered(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tables, mask = meta.decode_context(self.sliding_window, self.chunk_size)
        b, length = tables.shape[0], tables.shape[1] * meta.block_size
        k = self.k_cache[tables].view(b, length, self.num_kv_heads, self.head_dim)
        v = self.v_cache[tables].view(b, length, self.num_kv_heads, self.head_dim)
        out = self._attend(q.unsqueeze(2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), mask)
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int,
                 meta: AttentionMetadata, flat_k: torch.Tensor, flat_v: torch.Tensor) -> torch.Tensor:
        p = meta.prefills[index]
        rows = slice(p.query_start, p.query_end)
        whole = self.sliding_window is None and self.chunk_size is None
        if whole and self.plain and cpu_attention.prefill_serves(q, k, v):
            if p.num_computed == 0:
                keys, values = k[rows], v[rows]
            else:  # this chunk's keys are in the cache already, after the earlier ones
                keys, values = flat_k[p.context_slots].to(q.dtype), flat_v[p.context_slots].to(q.dtype)
            return cpu_attention.causal_prefill_attention(q[rows], keys, values, self.scale, p.num_computed)
        if p.num_computed == 0 and whole:
            return self._attend_rows(q[rows], k[rows], v[rows], None, causal=True)
        outs = []
        for lo, hi, first, mask in meta.prefill_blocks(index, self.sliding_window, self.chunk_size):
            queries = q[p.query_start + lo - p.num_computed : p.query_start + hi - p.num_computed]
            if p.context_slots is None:  # the whole sequence is in this step: position = row in the chunk
                span = slice(p.query_start + first, p.query_start + hi)
                keys, values = k[span], v[span]
            else:
                slots = p.context_slots[first:hi]
                keys, values = flat_k[slots].to(q.dtype), flat_v[slots].to(q.dtype)
            outs.append(self._attend_rows(queries, keys, values, mask))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     causal: bool = False) -> torch.Tensor:
        """q: [Q, Hq, D], k/v: [K, Hkv, D] of one sequence -> [Q, Hq, D]."""
        out = self._attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                           v.transpose(0, 1).unsqueeze(0), mask, causal=causal)
        return out.squeeze(0).transpose(0, 1)

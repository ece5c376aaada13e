"""Bindings of the attention kernels (csrc/cpu_attention.c, prefill_attention.c): decode attention straight from the
paged KV cache on CPU (float32, or bfloat16 with float32 accumulation), causal prefill attention (float32, flash
style) and its bidirectional form over packed sequences (encoders); with the checks of which tensors they take.

Gathering every sequence's blocks into a padded batch for SDPA copies the whole context once per layer and
step, which on CPU costs more than the attention itself; the kernel reads the blocks in place instead.
Without a C compiler, attention keeps the gather path (a warning says so).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from strata.kernels.cpu import build, cpu_kernels_apply
from strata.kernels.cpu.abi import F32, I32, I64, PTR

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def decode_library() -> ctypes.CDLL | None:
    return build.bind("cpu_attention", {
        # The fused decode path (decode_layer.c) calls scored_decode_attention through a pointer too.
        "scored_decode_attention": ([PTR] * 6 + [I64] * 6 + [F32, PTR, I32, I32, PTR, PTR, I64, PTR, F32, PTR], I32),
        "zero_blocks": ([PTR, I64, PTR, I64, I64], None)})


@functools.cache
def prefill_library() -> ctypes.CDLL | None:
    return build.bind("prefill_attention", {
        "causal_prefill_attention": ([PTR, I64, PTR, PTR, I64] + [I64] * 5 + [F32, PTR, I32], I32),
        "varlen_bidirectional_attention": ([PTR, I64, PTR, PTR, I64, PTR] + [I64] * 4 + [F32, PTR, I32], I32),
        "prefill_attention_head_multiple": ([], I32)})


def prefill_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `causal_prefill_attention` takes these float32 CPU heads: q [Q, Hq, D], k / v [K, Hkv, D], each
    head's values contiguous, k and v rows one stride apart (views into a qkv output, or gathered copies), a head
    size the build's tiles divide."""
    if not cpu_kernels_apply(q) or not q.dtype == k.dtype == v.dtype == torch.float32 or prefill_library() is None:
        return False
    multiple = prefill_library().prefill_attention_head_multiple()
    d = q.shape[2]
    return (multiple > 0 and d % multiple == 0 and q.stride(2) == 1 and q.stride(1) == d
            and k.stride() == v.stride() and k.stride(2) == 1 and k.stride(1) == d and q.shape[1] % k.shape[1] == 0)


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             offset: int = 0) -> torch.Tensor:
    """q: [Q, Hq, D] at positions offset .. offset + Q - 1 of a sequence, k / v: [offset + Q, Hkv, D] its keys
    and values from position 0 (see `prefill_serves`); each query sees the keys up to its own position. `scale`
    (> 0) multiplies the scores. Returns [Q, Hq, D]."""
    queries, heads, head_dim = q.shape
    if k.shape[0] != offset + queries:
        raise ValueError(f"{k.shape[0]} keys for {queries} queries after {offset} earlier tokens")
    out = torch.empty(queries, heads, head_dim, dtype=q.dtype)
    status = prefill_library().causal_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), queries, offset, heads, k.shape[1],
        head_dim, scale, out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError("CPU prefill attention could not allocate its scratch memory")
    if status != 0:
        raise ValueError(f"CPU prefill attention does not take {heads} heads of {head_dim} over {k.shape[1]}")
    return out


def varlen_bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_starts: torch.Tensor,
                                   scale: float) -> torch.Tensor:
    """Encoder attention of packed sequences without padding: q [T, Hq, D], k / v [T, Hkv, D] (see
    `prefill_serves`), `seq_starts` [B + 1] int64 on the CPU (sequence i is tokens seq_starts[i] ..
    seq_starts[i + 1] - 1); each query sees every key of its own sequence. Returns [T, Hq, D]."""
    tokens, heads, head_dim = q.shape
    starts = seq_starts.contiguous()
    if starts.dtype != torch.int64 or starts[0] != 0 or starts[-1] != tokens:
        raise ValueError(f"seq_starts must be int64 from 0 to {tokens} tokens, got {seq_starts.tolist()}")
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype)
    status = prefill_library().varlen_bidirectional_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), starts.data_ptr(), starts.numel() - 1,
        heads, k.shape[1], head_dim, scale, out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError("CPU encoder attention could not allocate its scratch memory")
    if status != 0:
        raise ValueError(f"CPU encoder attention does not take {heads} heads of {head_dim} over {k.shape[1]}")
    return out


def prepare() -> bool:
    """Builds (first use on this machine) and loads the kernel; False when it cannot be built here."""
    return decode_library() is not None


def available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer's decodes (float32 or bfloat16 on CPU, a cache of q's dtype or a
    bfloat16 one for float32 q, compiler present)."""
    return (cpu_kernels_apply(q) and q.dtype in _DTYPES
            and (k_cache.dtype == q.dtype or (q.dtype == torch.float32 and k_cache.dtype == torch.bfloat16))
            and decode_library() is not None)


def rows_serve(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether a decode step's new keys and values ([S, Hkv, D], e.g. views into a fused qkv output) can be
    written by the kernel itself: token rows with contiguous heads, one row stride, int64 slots."""
    return (k.stride() == v.stride() and k.stride(2) == 1 and k.stride(1) == k.shape[2]
            and slots.dtype == torch.int64 and slots.is_contiguous())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, first_keys: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [S, Hq, D]; caches: [blocks, block_size, Hkv, D]; block_tables: [S, max_blocks] int32;
    sequence s attends keys first_keys[s] .. seq_lens[s] - 1 (int32). Returns [S, Hq, D]. With
    `new_kv` = (k, v, slots) (see `rows_serve`) the step's keys and values are written to the cache first.
    `softcap`: scores become softcap * tanh(scores / softcap); `sinks` ([Hq]): one extra softmax logit per head,
    its weight dropped."""
    q = q.contiguous()
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")  # 0 means "no cap" to the kernel
    if sinks is not None:  # the kernel reads float32 [Hq]; usually already so, then no copy
        sinks = sinks.detach().to(torch.float32).contiguous()
    new_k, new_v, slots = new_kv if new_kv is not None else (None, None, None)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    status = decode_library().scored_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), first_keys.data_ptr(),
        seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        scale, out.data_ptr(), torch.get_num_threads(), _mode(q, k_cache),
        None if new_k is None else new_k.data_ptr(), None if new_v is None else new_v.data_ptr(),
        0 if new_k is None else new_k.stride(0), None if slots is None else slots.data_ptr(),
        0.0 if softcap is None else softcap, None if sinks is None else sinks.data_ptr())
    if status != 0:
        raise MemoryError("CPU attention kernel could not allocate its scratch memory")
    return out


def _mode(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """The kernel's dtypes: 0 all float32, 1 all bfloat16, 2 a bfloat16 cache read from (and written by) float32."""
    if k_cache.dtype == torch.float32:
        return 0
    return 1 if q.dtype == torch.bfloat16 else 2


class BlockZeroer:
    """Zeroes KV blocks of every layer's caches (contiguous [blocks, ...] CPU tensors) in one C call instead of an
    index_fill_ per layer and cache (a batch-1 decode of a 16-layer model: 0.11 ms a step on average before, 0.08
    after, the rest being the lookup of fresh blocks). `create` gives None when the kernel cannot serve them."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches  # kept: the C call writes through their addresses
        self.addresses = (ctypes.c_void_p * len(caches))(*(c.data_ptr() for c in caches))
        self.block_bytes = caches[0][0].numel() * caches[0].element_size()

    @staticmethod
    def create(caches: list[torch.Tensor]) -> BlockZeroer | None:
        if not caches or decode_library() is None or any(
                not cpu_kernels_apply(c) or not c.is_contiguous() or c.shape[1:] != caches[0].shape[1:]
                or c.dtype != caches[0].dtype for c in caches):
            return None
        return BlockZeroer(caches)

    def __call__(self, blocks: list[int]) -> None:
        ids = (ctypes.c_int64 * len(blocks))(*blocks)
        decode_library().zero_blocks(self.addresses, len(self.caches), ids, len(blocks), self.block_bytes)

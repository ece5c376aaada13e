"""GGUF (llama.cpp) tensor types kept in their blocks: the type table, a torch dequantizer (any device), products
`gguf_linear` (C kernels on CPU, strata/kernels/cpu/csrc/gguf_*.h) and per-row embedding lookups `embedding_rows`.

A GGUF weight is a uint8 tensor [N, row_bytes], one row per output feature: K values as K / values_per_block blocks
of bytes_per_block bytes, exactly as ggml stores them (spec: specs/gguf.md). Its rows may be a view with a longer
stride (a tensor-parallel shard of whole blocks of each row). Type numbers are ggml's."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.errors import ConfigError
from strata.gguf.types import (  # noqa: F401 - the table, re-exported for the kernels' users
    BF16,
    F16,
    F32,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPES,
    GGUFType,
    check_type,
    row_bytes,
    type_name,
)
from strata.kernels.cpu import abi, cpu_kernels_apply
from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.crossovers import SMALL_BATCH_GGUF
from strata.layers import onednn_weights


def _check_data(data: torch.Tensor, qtype: int, k: int) -> None:
    expected = row_bytes(qtype, k)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != expected or data.stride(1) != 1:
        raise ConfigError(f"a {type_name(qtype)} weight of {k} values a row must be uint8 [N, {expected}] with "
                          f"contiguous rows, got {data.dtype} {tuple(data.shape)} strides {data.stride()}")


def _f16(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The IEEE half whose little-endian bytes are lo, hi (uint8), as float32: any block offset, any device."""
    bits = lo.to(torch.int32) | (hi.to(torch.int32) << 8)
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)


def _half_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at `offset` of every block [..., bytes] as float32 [..., 1]."""
    return _f16(blocks[..., offset:offset + 1], blocks[..., offset + 1:offset + 2])


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] as their low nibbles then their high nibbles [..., 2n] (ggml's 32-value block order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(bytes_: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] as their 8n bits, little-endian (bit j of the word is value j) [..., 8n] uint8."""
    shifts = torch.arange(8, device=bytes_.device, dtype=torch.uint8)
    return ((bytes_.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _legacy(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks [..., bytes] as values [..., 32]."""
    d = _half_at(blocks, 0)
    if qtype == Q8_0:
        return blocks[..., 2:34].view(torch.int8).to(torch.float32) * d
    with_min = qtype in (Q4_1, Q5_1)
    start = 4 if with_min else 2
    if qtype in (Q5_0, Q5_1):
        q = _nibbles(blocks[..., start + 4:start + 20]) | (_bits(blocks[..., start:start + 4]) << 4)
    else:
        q = _nibbles(blocks[..., start:start + 16])
    if with_min:
        return d * q.to(torch.float32) + _half_at(blocks, 2)
    offset = 16 if qtype == Q5_0 else 8
    return d * (q.to(torch.float32) - offset)


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [..., 12] as the 8 sub-blocks' 6-bit scales and mins [..., 8] (uint8): sub-block j < 4
    keeps the low 6 bits of bytes j and j + 4; j >= 4 joins a nibble of byte j + 4 with the top 2 bits of j - 4 / j."""
    low, high, joined = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([low & 63, (joined & 15) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([high & 63, (joined >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc, mn


def _q4_q5_k(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_K / Q5_K blocks [..., bytes] as values [..., 256]: sub-block j is 32 values d * sc_j * q - dmin * mn_j."""
    sc, mn = k_scales_mins(blocks[..., 4:16])
    qs = blocks[..., 48:176] if qtype == Q5_K else blocks[..., 16:144]
    chunks = qs.unflatten(-1, (4, 32))  # chunk i: sub-block 2i in the low nibbles, 2i + 1 in the high
    q = torch.stack([chunks & 15, chunks >> 4], dim=-2).flatten(-3, -2)  # [..., 8, 32]
    if qtype == Q5_K:  # bit j of qh[l] is the fifth bit of value l of sub-block j
        shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8).unsqueeze(-1)
        q = q | (((blocks[..., 16:48].unsqueeze(-2) >> shifts) & 1) << 4)
    scale = (_half_at(blocks, 0) * sc.to(torch.float32)).unsqueeze(-1)
    minimum = (_half_at(blocks, 2) * mn.to(torch.float32)).unsqueeze(-1)
    return (scale * q.to(torch.float32) - minimum).flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [..., 210] as values [..., 256]: two halves of 128, each value's low 4 bits from ql, top 2 from
    qh; 16 sub-blocks of 16 values, d * sc * (q - 32)."""
    ql = blocks[..., 0:128].unflatten(-1, (2, 64))
    low = torch.cat([ql & 15, ql >> 4], dim=-1)  # [..., 2, 128]: value order of each half
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).unsqueeze(-1)
    high = ((blocks[..., 128:192].unflatten(-1, (2, 1, 32)) >> shifts) & 3).flatten(-2)  # [..., 2, 128]
    q = (low | (high << 4)).flatten(-2).to(torch.float32) - 32
    scale = _half_at(blocks, 208) * blocks[..., 192:208].view(torch.int8).to(torch.float32)  # [..., 16]
    return (scale.unsqueeze(-1) * q.unflatten(-1, (16, 16))).flatten(-2)


def dequantize(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """A GGUF weight uint8 [N, row_bytes] as float32 [N, k], on data's device (the reference of every kernel, and
    the path without a C compiler)."""
    _check_data(data, qtype, k)
    if qtype == F32:
        return data.view(torch.float32)
    if qtype in (F16, BF16):
        return data.view(torch.float16 if qtype == F16 else torch.bfloat16).to(torch.float32)
    t = TYPES[qtype]
    blocks = data.unflatten(1, (k // t.values_per_block, t.bytes_per_block))
    if qtype in (Q4_K, Q5_K):
        values = _q4_q5_k(blocks, qtype)
    elif qtype == Q6_K:
        values = _q6_k(blocks)
    else:
        values = _legacy(blocks, qtype)
    return values.reshape(data.shape[0], k)


# The types whose products have kernels with x rounded to 8 bits as llama.cpp rounds it (quantized_activations=int8).
INT8_ACTIVATION_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
ACTIVATIONS = ("float", "int8")


def kernel_kind(qtype: int, activations: str = "float") -> int:
    """The C kernels' name for a GGUF type (weight_only_matmul, weight_gemm, and the decode path's linear_t); with
    int8 activations, the kind whose products round x to Q8_0 / Q8_K blocks (weight_only_matmul only)."""
    check_type(qtype, "weight")
    if activations == "int8":
        check_int8_type(qtype, "weight")
        return abi.KIND_GGUF_Q8 + qtype
    return abi.KIND_GGUF + qtype


def check_int8_type(qtype: int, name: str) -> None:
    """ConfigError unless a type's products have int8-activation kernels."""
    if qtype not in INT8_ACTIVATION_TYPES:
        raise ConfigError(f"{name}: quantized_activations='int8' has no kernel for GGUF type {type_name(qtype)} (it "
                          f"has for {', '.join(type_name(t) for t in INT8_ACTIVATION_TYPES)}); use "
                          "quantized_activations='float'", param="quantized_activations")


def gguf_linear(x: torch.Tensor, data: torch.Tensor, qtype: int, k: int, bias: torch.Tensor | None = None,
                small_rows: int = SMALL_BATCH_GGUF, activations: str = "float") -> torch.Tensor:
    """x [..., k] (float32 or bfloat16) times a GGUF weight uint8 [N, row_bytes] (+ bias [N]): [..., N] in x's dtype.
    On CPU up to `small_rows` rows of x (crossovers.small_batch_rows of the type) run the small-batch C kernel
    (each weight row read once, its blocks dequantized in registers), more rows the C GEMM (the weight widened a
    cache-sized panel at a time; float32 weights: oneDNN's GEMM). Elsewhere, or without a C compiler (which
    strata.kernels.cpu.build warns about), the weight is dequantized for the call and F.linear runs.
    activations="int8": every row count (decode and prefill) rounds x to Q8_0 / Q8_K as llama.cpp does and runs the
    integer kernels (gguf_q8.h); refused with ConfigError where they cannot run (no C compiler, not on CPU)."""
    _check_data(data, qtype, k)
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the GGUF weight expects {k}")
    rows = cpu_matmul.float_rows(x)
    n = data.shape[0]
    if activations == "int8":
        if not cpu_kernels_apply(x) or not cpu_matmul.available():
            raise ConfigError("quantized_activations='int8' runs on strata's CPU C kernels only (a C compiler and "
                              "a CPU tensor); use quantized_activations='float'", param="quantized_activations")
        y = cpu_matmul.matmul(rows, data, kernel_kind(qtype, activations), n, bias=bias)
    elif not cpu_kernels_apply(x) or not cpu_matmul.available():
        y = F.linear(rows, dequantize(data, qtype, k), None if bias is None else bias.to(torch.float32))
    elif rows.shape[0] <= small_rows:
        y = cpu_matmul.matmul(rows, data, kernel_kind(qtype), n, bias=bias)
    elif qtype == F32:
        y = onednn_weights.gemm(rows, data.view(torch.float32), None if bias is None else bias.to(torch.float32))
    else:
        y = cpu_matmul.narrow_gemm(rows, data, kernel_kind(qtype), n, bias=bias)
    return cpu_matmul.like_rows(y, x)


def tiled_linear(x: torch.Tensor, tiles: torch.Tensor, qtype: int, k: int, n: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] times a GGUF weight of n outputs laid out for the int8 kernels' tiles (kernels.cpu.matmul's
    tile_for_int8), x rounded to Q8_0 blocks as with activations="int8": [..., n] in x's dtype."""
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the GGUF weight expects {k}")
    y = cpu_matmul.matmul(cpu_matmul.float_rows(x), tiles, abi.KIND_GGUF_Q8T + qtype, n, bias=bias)
    return cpu_matmul.like_rows(y, x)


def embedding_rows(data: torch.Tensor, qtype: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a GGUF table uint8 [V, row_bytes] as float32 [*ids.shape, k], each dequantized from its own
    blocks (no dequantized table): a C function on CPU, torch elsewhere."""
    _check_data(data, qtype, k)
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= data.shape[0]):
        raise IndexError(f"embedding ids must lie in 0..{data.shape[0] - 1}, got {int(flat.min())}..{int(flat.max())}")
    if cpu_kernels_apply(data) and cpu_matmul.available():
        out = cpu_matmul.rows(data, kernel_kind(qtype), k, flat.cpu())
    else:
        out = dequantize(data[flat.to(data.device)], qtype, k)
    return out.view(*ids.shape, k)

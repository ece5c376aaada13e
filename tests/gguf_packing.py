"""GGUF blocks written for tests: gguf-py's quantizer where it has one, blocks packed by hand as ggml lays them out
where it has none (Q4_K, Q5_K, Q6_K: simple scale choices, any valid encoding serves, since gguf-py's dequantize is
the oracle), and random valid blocks (random bytes with sane fp16 scales). Rows come as uint8 [N, row_bytes].
`with_expert_types` rewrites a GGUF file's routed experts in other types."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
SIZES = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
         Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), BF16: (1, 2)}
ALL_TYPES = tuple(SIZES)
# Byte offsets of each type's fp16 fields (d, and dmin or m).
_HALVES = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}


def _halves(values: np.ndarray) -> np.ndarray:
    """float values [...] as the bytes of their fp16 [..., 2]."""
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 8 scales and 8 mins (6 bits each, [B, 8]) as their 12 bytes [B, 12]: bytes 0-3 hold scales 0-3
    and the top 2 bits of scales 4-7, bytes 4-7 mins 0-3 and the top bits of mins 4-7, bytes 8-11 the low nibbles of
    scales 4-7 (low) and mins 4-7 (high)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K blocks from d, dmin [B], 6-bit scales and mins [B, 8] and values q [B, 8, 32] in 0..15: value l of
    sub-block j is d * sc_j * q - dmin * mn_j. Each 32 bytes of qs hold sub-block 2i in their low nibbles and
    2i + 1 in their high ones."""
    return _pack_q45_k(d, dmin, sc, mn, q, five=False)


def pack_q5_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q5_K blocks: as Q4_K with q in 0..31, whose fifth bits sit in qh (bit j of byte l: value l of sub-block j)."""
    return _pack_q45_k(d, dmin, sc, mn, q, five=True)


def _pack_q45_k(d, dmin, sc, mn, q, five: bool) -> np.ndarray:
    q = q.astype(np.uint8)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(len(q), 128)  # 32 bytes: sub-blocks 2i (low), 2i + 1 (high)
    parts = [_halves(d), _halves(dmin), pack_k_scales(sc, mn)]
    if five:  # bit j of qh[l]: the fifth bit of value l of sub-block j
        bits = (q >> 4) & 1
        parts.append((bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8))
    return np.concatenate([*parts, qs], axis=1)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks from d [B], int8 scales [B, 16] (one per 16 values) and q [B, 256] in 0..63: value i is
    d * sc[i // 16] * (q - 32). Per half of 128 values, ql byte l holds values l (low) and l + 64 (high), byte
    l + 32 values l + 32 and l + 96; qh byte l their top two bits, in that order from bit 0."""
    q = q.astype(np.uint8).reshape(len(q), 2, 4, 32)  # [half, quarter, l]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=2).reshape(len(q), 128)
    qh = sum((q[:, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8).reshape(len(q), 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _halves(d)], axis=1)


def _quantize_q45_k(blocks: np.ndarray, five: bool) -> np.ndarray:
    top = 31 if five else 15
    sub = blocks.reshape(len(blocks), 8, 32)
    mins = np.maximum(-sub.min(axis=2), 0)
    scales = (sub.max(axis=2) + mins) / top
    d = (scales.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.clip(np.round(scales / d[:, None]), 0, 63))
        mn = np.nan_to_num(np.clip(np.round(mins / dmin[:, None]), 0, 63))
        step = (d[:, None] * sc)[:, :, None]
        q = np.nan_to_num(np.round((sub + (dmin[:, None] * mn)[:, :, None]) / step), posinf=0, neginf=0)
    q = np.clip(q, 0, top)
    return _pack_q45_k(d, dmin, sc, mn, q, five)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(len(blocks), 16, 16)
    scales = np.abs(sub).max(axis=2) / 31
    d = (scales.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.clip(np.round(scales / d[:, None]), -128, 127))
        q = np.nan_to_num(np.round(sub / (d[:, None] * sc)[:, :, None]), posinf=0, neginf=0)
    return pack_q6_k(d, sc, np.clip(q + 32, 0, 63).reshape(len(blocks), 256))


def quantize(values: np.ndarray, qtype: int) -> np.ndarray:
    """float rows [N, K] as GGUF rows uint8 [N, row_bytes] of `qtype` (gguf-py's quantizer where it has one)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    n, k = values.shape
    if qtype in (Q4_K, Q5_K, Q6_K):
        blocks = values.reshape(-1, 256)
        packed = _quantize_q6_k(blocks) if qtype == Q6_K else _quantize_q45_k(blocks, five=qtype == Q5_K)
    else:
        packed = quants.quantize(values, GGMLQuantizationType(qtype))
    return np.ascontiguousarray(packed).view(np.uint8).reshape(n, -1)


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k values of random valid blocks: random bytes, fp16 fields set to small normal values (dense types:
    random values)."""
    rng = np.random.default_rng(seed)
    per_block, nbytes = SIZES[qtype]
    if per_block == 1:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, (n, k // per_block, nbytes), dtype=np.uint8)
    for offset in _HALVES[qtype]:
        blocks[..., offset:offset + 2] = _halves(rng.standard_normal((n, k // per_block)) * 0.01)
    return blocks.reshape(n, -1)


def reference(data: np.ndarray, qtype: int) -> np.ndarray:
    """gguf-py's dequantize of rows uint8 [N, row_bytes] as float64 [N, K] (the oracle)."""
    if qtype == F32:
        data = data.view(np.float32)
    elif qtype == F16:
        data = data.view(np.float16)
    return np.asarray(quants.dequantize(data, GGMLQuantizationType(qtype)), dtype=np.float64)


_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")


def with_expert_types(source: Path, out: Path, kinds: dict[str, int]) -> Path:
    """`source` (a GGUF file whose routed experts are F32) with its experts in `kinds` ({"gate"|"up"|"down": ggml
    type}, others left F32), every expert's rows quantized on their own; all else, metadata included, as it is."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    for i, tensor in enumerate(reader.tensors):
        match = _EXPERTS.match(tensor.name)
        if match is not None and match.group(1) in kinds:
            kind = kinds[match.group(1)]
            experts, rows, cols = tensor.data.shape
            data = quantize(np.asarray(tensor.data).reshape(experts * rows, cols), kind).reshape(experts, rows, -1)
            reader.tensors[i] = tensor._replace(data=data, tensor_type=GGMLQuantizationType(kind), n_bytes=data.nbytes)
    copy_with_new_metadata(reader, writer, {}, ())
    return out

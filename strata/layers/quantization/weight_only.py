"""Weight-only quantized linear layers (int4 / int8 / FP8 weights, float activations): the one packed layout strata
keeps in memory, `pack_weight` to build it from unsigned integers, scales and zero points (`pack_fp8` from float8
e4m3 values and per-channel scales), and `weight_only_linear` to multiply by it (a C kernel on CPU, which widens FP8
in registers, dequantize-then-matmul elsewhere).

Layout (one copy serves every batch size): K is padded to a multiple of 32 and cut into blocks of 32 values.
int8 stores one unsigned byte per value, FP8 its e4m3 byte; int4 stores a block in 16 bytes, byte j holding value
j in its low nibble and value j + 16 in its high nibble (so a SIMD register unpacks into two runs of 16 in order).
Scales (and zero points, when asymmetric) are float32 `[N, groups]`; a group covers `group_size` values of K
(a multiple of 32; per channel: all of K) and the last one may be short.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels.cpu import abi, cpu_kernels_apply
from strata.kernels.cpu import matmul as cpu_matmul
from strata.kernels.cpu.crossovers import SMALL_BATCH_WEIGHT_ONLY

BLOCK = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """One rank's weight: w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = k // group_size."""

    packed: torch.Tensor  # uint8 [N, padded_K * bits / 8]
    scales: torch.Tensor  # float32 [N, groups]
    zeros: torch.Tensor | None  # float32 [N, groups] in the unsigned domain; None: symmetric, 2^(bits-1)
    bits: int
    group_size: int  # -1: one scale per output channel
    out_features: int
    in_features: int
    float8: bool = False  # packed holds float8 e4m3 bytes (no zero points), not unsigned integers

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds in memory (and reads per product at batch 1)."""
        zeros = 0 if self.zeros is None else self.zeros.nbytes
        return self.packed.nbytes + self.scales.nbytes + zeros

    @property
    def padded_in_features(self) -> int:
        return _round_up(self.in_features, BLOCK)

    @property
    def effective_group_size(self) -> int:
        """Values of K per scale (the padded K when per channel)."""
        return self.padded_in_features if self.group_size == -1 else self.group_size

    def to(self, device: torch.device | str) -> QuantizedWeight:
        move = (lambda t: None if t is None else t.to(device))
        return QuantizedWeight(move(self.packed), move(self.scales), move(self.zeros), self.bits, self.group_size,
                               self.out_features, self.in_features, self.float8)

    @property
    def kernel_kind(self) -> int:
        """The C kernel's name for this weight's values."""
        if self.float8:
            return abi.KIND_FP8
        return abi.KIND_INT4 if self.bits == 4 else abi.KIND_INT8


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _check(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"weight-only quantization supports 4 or 8 bits, not {bits}")
    if q.dim() != 2:
        raise ValueError(f"quantized weight must be [out, in], got shape {tuple(q.shape)}")
    if group_size != -1 and (group_size <= 0 or group_size % BLOCK):
        raise ValueError(f"group size {group_size} is not supported: use -1 (per channel) or a multiple of {BLOCK}")
    n, k = q.shape
    groups = 1 if group_size == -1 else -(-k // group_size)
    if tuple(scales.shape) != (n, groups):
        raise ValueError(f"scales must be [{n}, {groups}] for a [{n}, {k}] weight with group size {group_size}, "
                         f"got {tuple(scales.shape)}")
    if zeros is not None and tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"zero points must have the scales' shape {tuple(scales.shape)}, got {tuple(zeros.shape)}")


def pack_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group_size: int) -> QuantizedWeight:
    """q: integer [N, K] with unsigned values 0 .. 2^bits - 1; scales: [N, ceil(K / group_size)] ([N, 1] per
    channel); zeros: like scales, unsigned, or None for symmetric (zero point 2^(bits-1))."""
    _check(q, scales, zeros, bits, group_size)
    n, k = q.shape
    values = q.to(torch.int32)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"quantized values must lie in 0..{(1 << bits) - 1} for {bits} bits")
    padded = F.pad(values, (0, _round_up(k, BLOCK) - k)).to(torch.uint8)
    if bits == 4:
        blocks = padded.view(n, -1, 2, BLOCK // 2)
        padded = blocks[:, :, 0] | (blocks[:, :, 1] << 4)
    return QuantizedWeight(padded.reshape(n, -1).contiguous(), scales.to(torch.float32).contiguous(),
                           None if zeros is None else zeros.to(torch.float32).contiguous(), bits, group_size, n, k)


def pack_fp8(weight: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """weight: float8_e4m3fn [N, K]; scales: float32, one per output channel ([N] or [N, 1]) or one for the whole
    tensor. The kernels do not decode e4m3's NaN codes, so a weight holding one is refused."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn [out, in], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    raw = weight.contiguous().view(torch.uint8)
    if bool(((raw & 0x7F) == 0x7F).any()):
        raise ValueError("the FP8 weight holds NaN values")
    scales = scales.to(torch.float32).reshape(-1)
    if scales.numel() not in (1, n):
        raise ValueError(f"FP8 scales must be one per output channel ({n}) or one per tensor, got {scales.numel()}")
    packed = F.pad(raw, (0, _round_up(k, BLOCK) - k)).contiguous()  # byte 0 is +0.0
    return QuantizedWeight(packed, scales.expand(n).reshape(n, 1).contiguous(), None, 8, -1, n, k, float8=True)


def unpack(w: QuantizedWeight) -> torch.Tensor:
    """The unsigned integers [N, K] (int32) that `pack_weight` was given."""
    n = w.out_features
    if w.bits == 4:
        blocks = w.packed.view(n, -1, 1, BLOCK // 2)
        values = torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(n, -1)
    else:
        values = w.packed
    return values[:, :w.in_features].to(torch.int32)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] (the reference every kernel is checked against)."""
    if w.float8:
        return w.packed[:, :w.in_features].contiguous().view(torch.float8_e4m3fn).to(torch.float32) * w.scales
    group = w.effective_group_size
    scales = w.scales.repeat_interleave(group, dim=1)[:, :w.in_features]
    if w.zeros is None:
        zeros = torch.full_like(scales, float(1 << (w.bits - 1)))
    else:
        zeros = w.zeros.repeat_interleave(group, dim=1)[:, :w.in_features]
    return (unpack(w).to(torch.float32) - zeros) * scales


def kernel_operands(w: QuantizedWeight) -> dict:
    """The weight as cpu_matmul's products take it (keywords)."""
    return {"weight": w.packed, "kind": w.kernel_kind, "out_features": w.out_features, "scales": w.scales,
            "zeros": w.zeros, "group_size": w.effective_group_size}


def weight_only_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                       small_rows: int = SMALL_BATCH_WEIGHT_ONLY) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) times the weight: [..., N] in x's dtype. On CPU, up to `small_rows` rows
    (crossovers.small_batch_rows of the weight's kind) run the small-batch C kernel (weights read once,
    dequantized in registers), more rows the C GEMM (the weight dequantized a cache-sized panel at a time).
    Elsewhere (CUDA, or no C compiler, which strata.kernels.cpu.build warns about) the plain-torch
    dequantize-then-matmul runs."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {w.in_features}")
    rows = cpu_matmul.float_rows(x)
    if not cpu_kernels_apply(x) or not cpu_matmul.available():
        y = F.linear(rows, dequantize(w), None if bias is None else bias.to(torch.float32))
    else:
        product = cpu_matmul.matmul if rows.shape[0] <= small_rows else cpu_matmul.narrow_gemm
        y = product(rows, **kernel_operands(w), bias=bias)
    return cpu_matmul.like_rows(y, x)

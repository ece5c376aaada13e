"""ctypes bindings of strata/csrc/weight_only.c: small-batch products read straight from float32, bfloat16, FP8,
int8 or int4 weights on CPU (every thread of the rank), and the dequantization large batches use."""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from strata import native
from strata.native import I32, I64, PTR

KIND_F32, KIND_BF16, KIND_INT4, KIND_INT8, KIND_FP8 = 0, 1, 4, 8, 9
_DENSE_KINDS = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native.bind("weight_only", {
        "weight_only_matmul": ([PTR, I64, I64, PTR, I64, I32, PTR, PTR, I64, I64, PTR, PTR, I64, I32], I32),
        "weight_only_dequantize": ([PTR, I64, I32, PTR, PTR, I64, I64, I64, I64, PTR, I32], None)})


def available() -> bool:
    """Whether the kernels can be built and loaded here (a C compiler is present)."""
    return _library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matmul(x: torch.Tensor, weight: torch.Tensor, kind: int, out_features: int, scales: torch.Tensor | None = None,
           zeros: torch.Tensor | None = None, group_size: int = -1, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 contiguous times the weight stored as `kind` (rows of `weight`, one per output):
    [M, out_features] float32. Scales/zeros: float32 [N, groups] for the quantized kinds."""
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=torch.float32)
    groups = 0 if scales is None else scales.shape[1]
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    status = _library().weight_only_matmul(
        x.data_ptr(), m, k, weight.data_ptr(), weight.stride(0) * weight.element_size(), kind, _ptr(scales),
        _ptr(zeros), groups, group_size, _ptr(bias), out.data_ptr(), out_features, torch.get_num_threads())
    if status != 0:
        raise MemoryError("weight-only matmul kernel could not allocate its scratch memory")
    return out


def dequantize(weight: torch.Tensor, kind: int, in_features: int, scales: torch.Tensor,
               zeros: torch.Tensor | None, group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 [N, in_features] matrix of packed int4 / int8 / FP8 rows (written into `out` when given)."""
    n = weight.shape[0]
    if out is None:
        out = torch.empty(n, in_features, dtype=torch.float32)
    _library().weight_only_dequantize(weight.data_ptr(), weight.stride(0), kind, scales.data_ptr(), _ptr(zeros),
                                      scales.shape[1], group_size, n, in_features, out.data_ptr(),
                                      torch.get_num_threads())
    return out


# A tile of a float32 weight widened (or dequantized) for one GEMM, kept in the last-level cache. oneDNN repacks a
# plain weight on every call, so few large tiles beat many L2-sized ones: 64 decodes of a W4A16 250M Llama ran 165
# tokens/s with 1 MiB tiles, 194 with 16 MiB (float32 weights: 197-221).
TILE_BYTES = 16 << 20


def tiled_gemm(x: torch.Tensor, n: int, fill: Callable[[torch.Tensor, int, int], torch.Tensor],
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 times a weight [n, K] that is never whole in float32: `fill(tile, n0, n1)` writes rows
    n0..n1 of it as float32 into `tile` (a cache-sized buffer) and returns them, and oneDNN's GEMM multiplies
    them there. [M, n] float32."""
    m, k = x.shape
    tile_rows = max(16, TILE_BYTES // (4 * max(1, k)))
    if n <= tile_rows:
        return gemm(x, fill(torch.empty(n, k, dtype=torch.float32), 0, n), bias)
    out = torch.empty(m, n, dtype=torch.float32)
    tile = torch.empty(tile_rows, k, dtype=torch.float32)
    for n0 in range(0, n, tile_rows):
        n1 = min(n, n0 + tile_rows)
        out[:, n0:n1] = gemm(x, fill(tile[:n1 - n0], n0, n1), None if bias is None else bias[n0:n1])
    return out


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T for a plain weight narrower than float32 (bfloat16 on a CPU without native bfloat16
    arithmetic, whose own bfloat16 GEMM runs about 5x slower): float32 tiles of the weight meet float32 rows in
    oneDNN's GEMM. Returns x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    fp32_bias = None if bias is None else bias.to(torch.float32)
    y = tiled_gemm(rows, weight.shape[0], lambda tile, n0, n1: tile.copy_(weight[n0:n1]), fp32_bias)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T for large batches: oneDNN reads a plain float32 weight about 15% faster than `F.linear`."""
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def dense_kind(weight: torch.Tensor) -> int | None:
    """The kernel kind of a plain [N, K] weight, or None when the kernel cannot read it."""
    if weight.device.type != "cpu" or weight.is_mkldnn or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    return _DENSE_KINDS.get(weight.dtype)

"""ctypes bindings of strata/csrc/weight_only.c and weight_gemm.c: products read straight from float32, bfloat16,
FP8, int8, int4 or GGUF block weights on CPU with every thread of the rank, a small-batch kernel (weights read once)
and a GEMM for larger batches (weights widened to float32 a cache-sized panel at a time)."""
from __future__ import annotations

import ctypes
import functools

import torch

from strata import native
from strata.native import I32, I64, PTR

KIND_F32, KIND_BF16, KIND_INT4, KIND_INT8, KIND_FP8 = 0, 1, 4, 8, 9
# GGUF weights in their blocks: KIND_GGUF + ggml's type number (gguf_quants.py); scales and zeros unused.
KIND_GGUF = 32
KIND_GGUF_F32, KIND_F16, KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0 = (KIND_GGUF + t for t in
                                                                                  (0, 1, 2, 3, 6, 7, 8))
KIND_Q4_K, KIND_Q5_K, KIND_Q6_K, KIND_GGUF_BF16 = (KIND_GGUF + t for t in (12, 13, 14, 30))
_DENSE_KINDS = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16}


_SIGNATURE = ([PTR, I64, I64, PTR, I64, I32, PTR, PTR, I64, I64, PTR, PTR, I64, I32], I32)


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native.bind("weight_only", {"weight_only_matmul": _SIGNATURE,
                                       "weight_rows": ([PTR, I64, I32, I64, PTR, I64, PTR, I32], I32),
                                       "weight_only_build": ([], ctypes.c_char_p),
                                       "set_fixed_point_rows": ([I32, I64], I32),
                                       "fixed_point_rows": ([I32], I64)})


def build() -> str:
    """Which kernels the small-batch products run here: the instruction set this machine's build compiled in."""
    lib = _library()
    return "none (no C compiler: torch's ops)" if lib is None else lib.weight_only_build().decode()


@functools.cache
def _gemm_library() -> ctypes.CDLL | None:
    return native.bind("weight_gemm", {"weight_gemm": _SIGNATURE, "set_gemm_engine": ([I32, I32], I32),
                                       "gemm_engine": ([I32], I32)})


def available() -> bool:
    """Whether the kernels can be built and loaded here (a C compiler is present)."""
    return _library() is not None and _gemm_library() is not None


def float_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [rows, K] float32 contiguous, the tensor itself when it already is: the no-op reshape, cast
    and copy still cost a decode step tens of microseconds each once the weights had left Python cold in cache."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()


def like_rows(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A product y [rows, N] of float_rows(x) in x's dtype and leading dimensions (y itself when it already is)."""
    if x.dim() == 2 and x.dtype == y.dtype:
        return y
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _product(function, x: torch.Tensor, weight: torch.Tensor, kind: int, out_features: int,
             scales: torch.Tensor | None, zeros: torch.Tensor | None, group_size: int,
             bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=torch.float32)
    groups = 0 if scales is None else scales.shape[1]
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    status = function(x.data_ptr(), m, k, weight.data_ptr(), weight.stride(0) * weight.element_size(), kind,
                      _ptr(scales), _ptr(zeros), groups, group_size, _ptr(bias), out.data_ptr(), out_features,
                      torch.get_num_threads())
    _check_status(status, kind, k)
    return out


def _check_status(status: int, kind: int, k: int) -> None:
    if status == -2:
        raise ValueError(f"the kernels do not read weight kind {kind} with rows of {k} values (a GGUF weight's rows "
                         "must be whole blocks)")
    if status != 0:
        raise MemoryError("weight-only product kernel could not allocate its scratch memory")


def rows(weight: torch.Tensor, kind: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, in range) of a weight stored as `kind` (GGUF blocks, or float32 / float16 / bfloat16) as
    float32 [len(ids), k]: an embedding looked up in its own storage."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    status = _library().weight_rows(weight.data_ptr(), weight.stride(0) * weight.element_size(), kind, k,
                                    ids.data_ptr(), ids.numel(), out.data_ptr(), torch.get_num_threads())
    _check_status(status, kind, k)
    return out


def matmul(x: torch.Tensor, weight: torch.Tensor, kind: int, out_features: int, scales: torch.Tensor | None = None,
           zeros: torch.Tensor | None = None, group_size: int = -1, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Few rows: x [M, K] float32 contiguous times the weight stored as `kind` (rows of `weight`, one per output),
    each weight row read once for all of x: [M, out_features] float32. Scales/zeros: float32 [N, groups] for the
    quantized kinds."""
    return _product(_library().weight_only_matmul, x, weight, kind, out_features, scales, zeros, group_size, bias)


def narrow_gemm(x: torch.Tensor, weight: torch.Tensor, kind: int, out_features: int,
                scales: torch.Tensor | None = None, zeros: torch.Tensor | None = None, group_size: int = -1,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Many rows (prefill, batched decode): as `matmul`, for a weight narrower than float32 (bfloat16, int8, int4,
    FP8), which is widened into float32 in cache a panel at a time, never whole."""
    return _product(_gemm_library().weight_gemm, x, weight, kind, out_features, scales, zeros, group_size, bias)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T for many rows and a plain bfloat16 weight on a CPU without native bfloat16 arithmetic (whose own
    bfloat16 GEMM runs about 5x slower): float32 rows times the weight widened in the GEMM (without a C compiler,
    which native.py warns about, a float32 copy of it). Returns x's dtype."""
    rows = float_rows(x)
    if not available():
        y = torch.nn.functional.linear(rows, weight.float(), None if bias is None else bias.float())
    else:
        y = narrow_gemm(rows, weight if weight.stride(1) == 1 else weight.contiguous(), KIND_BF16, weight.shape[0],
                        bias=bias)
    return like_rows(y, x)


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

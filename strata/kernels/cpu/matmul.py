"""Bindings of the linear products (csrc/weight_only.c, weight_gemm.c, blocked_matmul.c): products read straight from
float32, bfloat16, FP8, int8, int4, GGUF or MXFP4 block weights on CPU with every thread of the rank, a small-batch
kernel (weights read once) and a GEMM for larger batches (weights widened to float32 a cache-sized panel at a time),
and the small-batch kernel that reads oneDNN's packed float weights in place."""
from __future__ import annotations

import ctypes
import functools

import torch

from strata.host_memory import huge_page_zeros
from strata.kernels.cpu import abi, build, cpu_kernels_apply
from strata.kernels.cpu.abi import I32, I64, PTR

_DENSE_KINDS = {torch.float32: abi.KIND_F32, torch.bfloat16: abi.KIND_BF16}
_SIGNATURE = ([PTR, I64, I64, PTR, I64, I32, PTR, PTR, I64, I64, PTR, PTR, I64, I32], I32)


@functools.cache
def weight_only_library() -> ctypes.CDLL | None:
    return build.bind("weight_only", {"weight_only_matmul": _SIGNATURE,
                                      "weight_rows": ([PTR, I64, I32, I64, PTR, I64, PTR, I32], I32),
                                      "weight_only_build": ([], ctypes.c_char_p),
                                      "int8_activations_build": ([], ctypes.c_char_p),
                                      "set_fixed_point_rows": ([I32, I64], I32),
                                      "q8_rounded_row_bytes": ([I64, I32], I64),
                                      "q8_tiled_strip_bytes": ([I32, I64], I64),
                                      "q8_tile_weight": ([PTR, I64, I64, I64, I32, PTR, I32], I32),
                                      "q8_round_rows": ([PTR, I64, I64, I32, PTR, I32], I32),
                                      "q8_rounded_matmul": ([PTR, I64, PTR, I64, PTR, I64, I32, PTR, PTR, PTR, I64,
                                                             I32], I32),
                                      "fixed_point_rows": ([I32], I64)})


@functools.cache
def gemm_library() -> ctypes.CDLL | None:
    return build.bind("weight_gemm", {"weight_gemm": _SIGNATURE, "set_gemm_engine": ([I32, I32], I32),
                                      "gemm_engine": ([I32], I32)})


@functools.cache
def blocked_library() -> ctypes.CDLL | None:
    return build.bind("blocked_matmul", {"blocked_matmul": (
        [PTR, I64, I64, PTR, I32, I64, I64, I64, PTR, PTR, I32, I32], I32)})


def instruction_set() -> str:
    """Which kernels the small-batch products run here: the instruction set this machine's build compiled in."""
    lib = weight_only_library()
    return "none (no C compiler: torch's ops)" if lib is None else lib.weight_only_build().decode()


def int8_activations_set() -> str:
    """Which kernels the GGUF products with x rounded to 8 bits (quantized_activations=int8) run on here."""
    lib = weight_only_library()
    return "none (no C compiler)" if lib is None else lib.int8_activations_build().decode()


def available() -> bool:
    """Whether the kernels can be built and loaded here (a C compiler is present)."""
    return weight_only_library() is not None and gemm_library() is not None


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
    status = weight_only_library().weight_rows(weight.data_ptr(), weight.stride(0) * weight.element_size(), kind, k,
                                               ids.data_ptr(), ids.numel(), out.data_ptr(), torch.get_num_threads())
    _check_status(status, kind, k)
    return out


def matmul(x: torch.Tensor, weight: torch.Tensor, kind: int, out_features: int, scales: torch.Tensor | None = None,
           zeros: torch.Tensor | None = None, group_size: int = -1, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Few rows: x [M, K] float32 contiguous times the weight stored as `kind` (rows of `weight`, one per output),
    each weight row read once for all of x: [M, out_features] float32. Scales/zeros: float32 [N, groups] for the
    quantized kinds."""
    return _product(weight_only_library().weight_only_matmul, x, weight, kind, out_features, scales, zeros,
                    group_size, bias)


def round_rows(x: torch.Tensor, per_block: int) -> torch.Tensor:
    """x [M, K] float32 contiguous rounded to 8 bits as llama.cpp rounds it, in blocks of `per_block` (32: Q8_0 /
    Q8_1, 256: Q8_K): uint8 [M, row bytes] of the C layout (gguf_q8.h), for `rounded_matmul` to read, once per input
    however many weights multiply it (the routed experts a token goes to)."""
    lib = weight_only_library()
    stride = lib.q8_rounded_row_bytes(x.shape[1], per_block)
    if stride < 0:
        raise ValueError(f"rows of {x.shape[1]} values are not whole blocks of {per_block}")
    out = torch.empty(x.shape[0], stride, dtype=torch.uint8)
    _check_status(lib.q8_round_rows(x.data_ptr(), x.shape[0], x.shape[1], per_block, out.data_ptr(),
                                    torch.get_num_threads()), -1, x.shape[1])
    return out


def tile_for_int8(weight: torch.Tensor, kind: int, k: int) -> torch.Tensor | None:
    """A GGUF weight uint8 [N, row bytes] of `kind` (abi.KIND_GGUF + ggml's type) laid out once in the int8 kernels'
    tiles (gguf_q8_tiled.h): uint8 [ceil(N / 16), strip bytes], on huge pages as the blocks are (decode streams it),
    for `matmul` as abi.KIND_GGUF_Q8T + ggml's type. None where this build has no kernels for that layout (they need
    AVX2) or the kind has none."""
    lib = weight_only_library()
    if lib is None:
        return None
    strip_bytes = lib.q8_tiled_strip_bytes(kind, k)
    if strip_bytes < 0:
        return None
    n = weight.shape[0]
    out = huge_page_zeros((n + 15) // 16, strip_bytes)
    _check_status(lib.q8_tile_weight(weight.data_ptr(), weight.stride(0) * weight.element_size(), n, k, kind,
                                     out.data_ptr(), torch.get_num_threads()), kind, k)
    return out


def rounded_matmul(rounded: torch.Tensor, k: int, ids: torch.Tensor | None, weight: torch.Tensor, kind: int,
                   out_features: int, exps: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (int64; every row when None) of x rounded by `round_rows` times a weight stored as `kind`
    (abi.KIND_GGUF_Q8 + ggml's type, or abi.KIND_MXFP4 with its uint8 exponents `exps` [N, K / 32]):
    [rows, out_features] float32."""
    count = rounded.shape[0] if ids is None else ids.numel()
    out = torch.empty(count, out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    status = weight_only_library().q8_rounded_matmul(
        rounded.data_ptr(), k, _ptr(ids), count, weight.data_ptr(), weight.stride(0) * weight.element_size(), kind,
        _ptr(exps), _ptr(bias), out.data_ptr(), out_features, torch.get_num_threads())
    _check_status(status, kind, k)
    return out


def narrow_gemm(x: torch.Tensor, weight: torch.Tensor, kind: int, out_features: int,
                scales: torch.Tensor | None = None, zeros: torch.Tensor | None = None, group_size: int = -1,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Many rows (prefill, batched decode): as `matmul`, for a weight narrower than float32 (bfloat16, int8, int4,
    FP8), which is widened into float32 in cache a panel at a time, never whole."""
    return _product(gemm_library().weight_gemm, x, weight, kind, out_features, scales, zeros, group_size, bias)


def dense_kind(weight: torch.Tensor) -> int | None:
    """The kernel kind of a plain [N, K] weight, or None when the kernel cannot read it."""
    if not cpu_kernels_apply(weight) or weight.is_mkldnn or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    return _DENSE_KINDS.get(weight.dtype)


def blocked_matmul(rows: torch.Tensor, address: int, bf16_weight: bool, block: int, k_pad: int, n: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] (float32 or bfloat16, contiguous) times a weight in oneDNN's blocked layout at `address` (outputs
    in blocks of `block`, each of `k_pad` rows of inputs): [M, n] in rows' dtype, the math in float32."""
    out = torch.empty(rows.shape[0], n, dtype=rows.dtype)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    status = blocked_library().blocked_matmul(
        rows.data_ptr(), rows.shape[0], rows.shape[1], address, int(bf16_weight), block, k_pad, n, _ptr(bias),
        out.data_ptr(), torch.get_num_threads(), int(rows.dtype == torch.bfloat16))
    if status == -2:
        raise MemoryError("blocked matmul kernel could not allocate its scratch memory")
    if status != 0:
        raise ValueError(f"a blocked layout of {block} outputs a block, {k_pad} inputs, is not supported by the kernel")
    return out

"""Bindings of the fused decode path (csrc/decode_layer.c): a decode step's attention and MLP blocks, a stack of
layers, or a single-stage model's whole step, each as one C call through the other libraries' entry points."""
from __future__ import annotations

import ctypes
import functools

from strata.kernels.cpu import activation, attention, build, lora, matmul, norm_rope
from strata.kernels.cpu.abi import F32, PTR, Kernels, Step


@functools.cache
def library() -> ctypes.CDLL | None:
    blocks = [ctypes.POINTER(Kernels), PTR, ctypes.POINTER(Step), PTR, PTR]
    return build.bind("decode_layer", {
        "attention_block": (blocks + [ctypes.c_int, PTR, PTR], ctypes.c_int),
        "mlp_block": (blocks + [PTR, PTR], ctypes.c_int),
        "decode_layers": ([ctypes.POINTER(Kernels), PTR, PTR, ctypes.c_int64, ctypes.POINTER(Step), PTR, PTR,
                           ctypes.c_int, PTR, PTR, PTR, PTR, F32], ctypes.c_int),
        "decode_forward": ([ctypes.POINTER(Kernels), PTR, PTR, ctypes.c_int64, ctypes.POINTER(Step), PTR, PTR, PTR,
                            PTR, PTR, PTR], ctypes.c_int),
        "first_argmax": ([PTR, ctypes.c_int64, ctypes.c_int64, PTR], None)})


@functools.cache
def kernels() -> Kernels | None:
    """The other libraries' entry points, or None when one of them cannot be built here."""
    sources = {"weight_only": (matmul.weight_only_library, "weight_only_matmul"),
               "blocked": (matmul.blocked_library, "blocked_matmul"),
               "rms_norm": (norm_rope.rms_norm_library, "rms_norm"),
               "rope": (norm_rope.rotary_library, "rope_half_split"), "silu": (activation.library, "silu_and_mul"),
               "attention": (attention.decode_library, "scored_decode_attention"),
               "norm_heads": (norm_rope.rms_norm_library, "rms_norm_heads"),
               "rows": (matmul.weight_only_library, "weight_rows"),
               "gelu": (activation.library, "gelu_tanh_and_mul"), "gemm": (matmul.gemm_library, "weight_gemm"),
               "lora": (lora.library, "lora_apply")}
    addresses = {}
    for field, (load, name) in sources.items():
        lib = load()
        if lib is None:
            return None
        addresses[field] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    return Kernels(**addresses)

"""What strata's C libraries share with Python, in one place: the ctypes argument types, the Structures that mirror
decode_layer.c's typedefs, the weight kinds and other constants of the C headers; and `check`, which compares them at
load with the sizes, offsets and values each library reports itself (its `strata_abi_<name>` table, csrc/abi.h)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from strata.errors import StrataError

# ctypes argument types, so that signatures read like the C ones.
PTR, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

# The `bf16` flag of the row-wise kernels (RMSNorm, rotary, gated activations) for each dtype they take.
DTYPE_FLAGS = {torch.float32: 0, torch.bfloat16: 1}
# Weight kinds of the products (weight_values.h, gguf_blocks.h, mxfp4.h): dense and strata's quantized layouts ...
KIND_F32, KIND_BF16, KIND_INT4, KIND_INT8, KIND_FP8 = 0, 1, 4, 8, 9
KIND_MXFP4 = 16  # clear of the dense kinds and of KIND_GGUF + ggml's types
# ... and GGUF weights in their blocks: KIND_GGUF + ggml's type number; scales and zeros unused.
KIND_GGUF = 32
KIND_GGUF_F32, KIND_F16, KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0 = (KIND_GGUF + t for t in
                                                                                  (0, 1, 2, 3, 6, 7, 8))
KIND_Q4_K, KIND_Q5_K, KIND_Q6_K, KIND_GGUF_BF16 = (KIND_GGUF + t for t in (12, 13, 14, 30))
# ... and the same blocks times x rounded to 8 bits as llama.cpp rounds it (gguf_q8.h): KIND_GGUF_Q8 + ggml's type.
KIND_GGUF_Q8 = 64
# ... and with the weight laid out once in the int8 kernels' tiles (gguf_q8_tiled.h): KIND_GGUF_Q8T + ggml's type.
KIND_GGUF_Q8T = 96
# The large-batch GEMM's engines (set_gemm_engine in weight_gemm.c).
GEMM_FMA, GEMM_AMX = 0, 1
# Bytes before the first slot of a shared-memory segment: a flag line per rank (shm_collectives.c).
SHM_HEADER_BYTES = 4096


class KernelAbiError(StrataError):
    """A C library whose layout or constants differ from strata/kernels/cpu/abi.py's: calling it would corrupt
    memory, so it is never used."""


class Kernels(ctypes.Structure):
    """The other libraries' entry points the fused decode calls reach (function pointers)."""

    c_type = "kernels_t"
    _fields_ = [(name, PTR) for name in ("weight_only", "blocked", "rms_norm", "rope", "silu", "attention",
                                         "norm_heads", "rows", "gelu", "gemm", "lora")]


class Linear(ctypes.Structure):
    c_type = "linear_t"


Linear._fields_ = [("blocked", I64), ("n", I64), ("k", I64), ("weight", PTR), ("bias", PTR), ("bf16", I64),
                   ("block", I64), ("k_pad", I64), ("row_bytes", I64), ("kind", I64), ("groups", I64),
                   ("group_size", I64), ("scales", PTR), ("zeros", PTR), ("n_pieces", I64),
                   ("pieces", ctypes.POINTER(Linear)), ("gemm_rows", I64), ("lora", PTR)]


class AttentionBlock(ctypes.Structure):
    c_type = "attention_block_t"
    _fields_ = [("norm_weight", PTR), ("eps", F32), ("hidden", I64), ("num_heads", I64), ("num_kv_heads", I64),
                ("head_dim", I64), ("block_size", I64), ("scale", F32), ("qkv", Linear), ("o", Linear),
                ("k_cache", PTR), ("v_cache", PTR), ("q_norm", PTR), ("k_norm", PTR), ("qk_eps", F32),
                ("rotary_dim", I64), ("ranges", I64), ("out_scale", F32), ("softcap", F32), ("sinks", PTR),
                ("out_norm", PTR), ("out_eps", F32), ("rope", I64), ("kv_bf16", I64)]


class MlpBlock(ctypes.Structure):
    c_type = "mlp_block_t"
    _fields_ = [("norm_weight", PTR), ("eps", F32), ("hidden", I64), ("intermediate", I64), ("gate_up", Linear),
                ("down", Linear), ("out_scale", F32), ("gelu", I64), ("out_norm", PTR), ("out_eps", F32)]


class KeyRanges(ctypes.Structure):
    c_type = "key_ranges_t"
    _fields_ = [("max_blocks", I64), ("block_tables", PTR), ("first_keys", PTR), ("seq_lens", PTR)]


class Step(ctypes.Structure):
    c_type = "decode_step_t"
    _fields_ = [("tokens", I64), ("cos", PTR), ("sin", PTR), ("ranges", ctypes.POINTER(KeyRanges)),
                ("slots", PTR), ("threads", I64), ("lora_slots", PTR)]


class Model(ctypes.Structure):
    c_type = "decode_model_t"
    _fields_ = [("table", PTR), ("vocab", I64), ("bf16", I64), ("rope_cos", PTR), ("rope_sin", PTR),
                ("rope_rows", I64), ("rope_half", I64), ("ropes", I64), ("final_norm", PTR), ("final_eps", F32),
                ("head", Linear), ("table_kind", I64), ("table_row_bytes", I64), ("embed_scale", F32),
                ("logits_divisor", F32), ("final_softcap", F32)]


class Lora(ctypes.Structure):
    """A linear layer's LoRA slots as lora.c reads them (strata/layers/lora.py's tensors)."""

    c_type = "lora_t"
    _fields_ = [("a", PTR), ("bt", PTR), ("in_features", I64), ("out_features", I64), ("width", I64),
                ("blocks", I64), ("slots", I64), ("block_rows", PTR), ("ranks", PTR), ("widths", PTR),
                ("scales", PTR)]


@dataclass(frozen=True)
class Shared:
    """What one library shares beyond its function signatures: constants (by their C names) and Structures."""

    constants: dict[str, int] = field(default_factory=dict)
    structures: tuple[type[ctypes.Structure], ...] = ()


_WEIGHT_KINDS = {"KIND_F32": KIND_F32, "KIND_BF16": KIND_BF16, "KIND_INT4": KIND_INT4, "KIND_INT8": KIND_INT8,
                 "KIND_FP8": KIND_FP8, "KIND_GGUF": KIND_GGUF, "KIND_F16": KIND_F16, "KIND_GGUF_F32": KIND_GGUF_F32,
                 "KIND_Q4_0": KIND_Q4_0, "KIND_Q4_1": KIND_Q4_1, "KIND_Q5_0": KIND_Q5_0, "KIND_Q5_1": KIND_Q5_1,
                 "KIND_Q8_0": KIND_Q8_0, "KIND_Q4_K": KIND_Q4_K, "KIND_Q5_K": KIND_Q5_K, "KIND_Q6_K": KIND_Q6_K,
                 "KIND_GGUF_BF16": KIND_GGUF_BF16}
SHARED: dict[str, Shared] = {
    "weight_only": Shared({**_WEIGHT_KINDS, "KIND_MXFP4": KIND_MXFP4, "KIND_GGUF_Q8": KIND_GGUF_Q8,
                            "KIND_GGUF_Q8T": KIND_GGUF_Q8T}),
    "weight_gemm": Shared({**_WEIGHT_KINDS, "GEMM_FMA": GEMM_FMA, "GEMM_AMX": GEMM_AMX}),
    "shm_collectives": Shared({"HEADER_BYTES": SHM_HEADER_BYTES}),
    "decode_layer": Shared(structures=(Kernels, Linear, AttentionBlock, MlpBlock, KeyRanges, Step, Model)),
    "lora": Shared(structures=(Lora,)),
}  # the other libraries report empty tables


def reported(name: str, lib: ctypes.CDLL) -> dict[str, tuple[int, int]]:
    """The library's own table: "type" -> (sizeof, alignment), "type.field" -> (offset, size), constant -> (value,
    0). KernelAbiError where the library has none (built from other sources)."""
    try:
        table = getattr(lib, f"strata_abi_{name}")
    except AttributeError:
        raise KernelAbiError(f"the C library {name} has no strata_abi_{name}: it was not built from "
                             "strata/kernels/cpu/csrc") from None
    table.argtypes = [I64, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(I64), ctypes.POINTER(I64)]
    table.restype = I32
    entry, value, size = ctypes.c_char_p(), I64(), I64()
    entries: dict[str, tuple[int, int]] = {}
    while table(len(entries), ctypes.byref(entry), ctypes.byref(value), ctypes.byref(size)) == 0:
        entries[entry.value.decode()] = (value.value, size.value)
    return entries


def mismatches(entries: dict[str, tuple[int, int]], shared: Shared) -> list[str]:
    """Every way `shared` (the Python side) disagrees with a library's reported `entries`, one line each."""
    found = []
    for constant, value in shared.constants.items():
        if constant not in entries:
            found.append(f"{constant} is {value} here and unknown to the C library")
        elif entries[constant][0] != value:
            found.append(f"{constant} is {entries[constant][0]} in C, {value} here")
    for structure in shared.structures:
        found += _structure_mismatches(entries, structure)
    return found


def _structure_mismatches(entries: dict[str, tuple[int, int]], structure: type[ctypes.Structure]) -> list[str]:
    c_type, python = structure.c_type, f"{structure.__name__} ({structure.c_type})"
    if c_type not in entries:
        return [f"{python} is unknown to the C library"]
    found = []
    size, alignment = entries[c_type]
    if (size, alignment) != (ctypes.sizeof(structure), ctypes.alignment(structure)):
        found.append(f"{python} has size {size} and alignment {alignment} in C, {ctypes.sizeof(structure)} and "
                     f"{ctypes.alignment(structure)} here")
    names = [name for name, *_ in structure._fields_]
    for name in names:
        here = getattr(structure, name)
        c = entries.get(f"{c_type}.{name}")
        if c is None:
            found.append(f"{python} field {name} is not in the C struct")
        elif c != (here.offset, here.size):
            found.append(f"{python} field {name} is at offset {c[0]} (size {c[1]}) in C, {here.offset} (size "
                         f"{here.size}) here")
    found += [f"{python} lacks the C field {key.partition('.')[2]}" for key in entries
              if key.startswith(c_type + ".") and key.partition(".")[2] not in names]
    return found


def check(name: str, lib: ctypes.CDLL, shared: Shared | None = None) -> None:
    """Raises KernelAbiError, naming every difference, unless library `name` lays out and numbers what it shares
    with Python (SHARED[name], or `shared`) exactly as this module does."""
    found = mismatches(reported(name, lib), SHARED.get(name, Shared()) if shared is None else shared)
    if found:
        raise KernelAbiError(f"the C library {name} does not match strata/kernels/cpu/abi.py (a source changed on one "
                             "side only):\n  " + "\n  ".join(found))

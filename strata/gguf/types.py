"""The ggml tensor types strata reads from GGUF files: each type's block (values and bytes), and the checks that
refuse the others naming the tensor."""
from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError


@dataclass(frozen=True)
class GGUFType:
    name: str
    values_per_block: int
    bytes_per_block: int


# ggml's GGMLQuantizationType numbers.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
TYPES: dict[int, GGUFType] = {
    F32: GGUFType("F32", 1, 4), F16: GGUFType("F16", 1, 2), Q4_0: GGUFType("Q4_0", 32, 18),
    Q4_1: GGUFType("Q4_1", 32, 20), Q5_0: GGUFType("Q5_0", 32, 22), Q5_1: GGUFType("Q5_1", 32, 24),
    Q8_0: GGUFType("Q8_0", 32, 34), Q4_K: GGUFType("Q4_K", 256, 144), Q5_K: GGUFType("Q5_K", 256, 176),
    Q6_K: GGUFType("Q6_K", 256, 210), BF16: GGUFType("BF16", 1, 2)}
# llama.cpp's MXFP4 (gpt-oss's experts: one e8m0 exponent, then 16 bytes of e2m1 codes, value j in the low nibble of
# byte j and value j + 16 in its high one): sizes are read, and strata.gguf.gpt_oss repacks the experts' blocks into
# strata's MXFP4 layout at load, but no linear layer runs it (check_type refuses it).
MXFP4 = 39
READ_ONLY: dict[int, GGUFType] = {MXFP4: GGUFType("MXFP4", 32, 17)}
# ggml's names of the types strata refuses, for the message.
_OTHER_NAMES = {4: "Q4_2", 5: "Q4_3", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
                18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8",
                25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


def type_name(qtype: int) -> str:
    known = TYPES.get(qtype)
    return known.name if known else _OTHER_NAMES.get(qtype, f"unknown type {qtype}")


def check_type(qtype: int, name: str) -> GGUFType:
    """The type's table entry, or a ConfigError naming the tensor and its type when strata cannot run it."""
    known = TYPES.get(qtype)
    if known is None:
        supported = ", ".join(t.name for t in TYPES.values())
        where = " (strata reads MXFP4 for gpt-oss's routed experts only)" if qtype == MXFP4 else ""
        raise ConfigError(f"GGUF tensor {name!r} has type {type_name(qtype)} ({qtype}), which strata does not run"
                          f"{where}; supported types: {supported}. Use a file quantized to one of them (e.g. Q4_K_M, "
                          "Q8_0).",
                          param="model")
    return known


def row_bytes(qtype: int, k: int, name: str = "weight") -> int:
    """Bytes of one row of k values; refuses k that is not a whole number of blocks."""
    t = READ_ONLY.get(qtype) or check_type(qtype, name)
    if k <= 0 or k % t.values_per_block:
        raise ConfigError(f"{name}: a {t.name} row holds whole blocks of {t.values_per_block} values, not {k}",
                          param="model")
    return k // t.values_per_block * t.bytes_per_block


def tensor_nbytes(name: str, qtype: int, shape: tuple[int, ...]) -> int:
    """Bytes of a whole tensor of torch-order `shape` (rows of its last dimension)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_bytes(qtype, shape[-1] if shape else 1, name)

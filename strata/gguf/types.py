"""The ggml tensor types strata reads from GGUF files: each type's block (values and bytes), and the check that
refuses the others naming the tensor."""
from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError


@dataclass(frozen=True)
class GGMLType:
    name: str
    block_values: int  # values of a row in one block
    block_bytes: int


# ggml's GGMLQuantizationType numbers.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
TYPES: dict[int, GGMLType] = {
    F32: GGMLType("F32", 1, 4), F16: GGMLType("F16", 1, 2), BF16: GGMLType("BF16", 1, 2),
    Q4_0: GGMLType("Q4_0", 32, 18), Q4_1: GGMLType("Q4_1", 32, 20), Q5_0: GGMLType("Q5_0", 32, 22),
    Q5_1: GGMLType("Q5_1", 32, 24), Q8_0: GGMLType("Q8_0", 32, 34), Q4_K: GGMLType("Q4_K", 256, 144),
    Q5_K: GGMLType("Q5_K", 256, 176), Q6_K: GGMLType("Q6_K", 256, 210),
}
# Types of other ggml versions, named in errors.
_OTHER_NAMES = {9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
                19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
                27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


def type_name(ggml_type: int) -> str:
    known = TYPES.get(ggml_type)
    return known.name if known else _OTHER_NAMES.get(ggml_type, f"unknown type {ggml_type}")


def check_type(ggml_type: int, tensor: str) -> GGMLType:
    """The type's block, or a ConfigError naming the tensor, its type and the types strata reads."""
    if ggml_type not in TYPES:
        supported = ", ".join(t.name for t in TYPES.values())
        raise ConfigError(f"GGUF tensor {tensor} is stored as {type_name(ggml_type)}, which strata does not read "
                          f"(supported: {supported}); use a file quantized to one of those (e.g. Q4_K_M, Q8_0)",
                          param="model")
    return TYPES[ggml_type]


def row_bytes(ggml_type: int, values: int, tensor: str = "") -> int:
    """Bytes of one row of `values` values; the row must hold whole blocks."""
    t = check_type(ggml_type, tensor)
    if values % t.block_values:
        raise ConfigError(f"GGUF tensor {tensor}: a row of {values} values is not a whole number of {t.name} blocks "
                          f"of {t.block_values}", param="model")
    return values // t.block_values * t.block_bytes


def tensor_nbytes(name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a whole tensor of torch-order `shape` (rows of its last dimension)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_bytes(ggml_type, shape[-1] if shape else 1, name)

"""strata's CPU backend: the C kernels (csrc/, one ISA header isa.h), their build (build.py), what they share with
Python (abi.py, checked at load), their ctypes bindings by meaning (matmul, attention, norm_rope, activation,
decode_layer, collectives, lora), every crossover between kernels with its calibration (crossovers.py), and
`cpu_kernels_apply`, the one test layers make before choosing a C kernel over torch."""
from __future__ import annotations

import torch


def cpu_kernels_apply(t: torch.Tensor) -> bool:
    """Whether strata's C kernels may take `t` at all: it lives in CPU memory (each kernel then checks its dtypes,
    shapes and strides, and that its library was built here)."""
    return t.device.type == "cpu"

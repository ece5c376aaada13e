"""Rows of x rounded to 8 bits as llama.cpp rounds them (quantized_activations=int8), once per input: a step's
tokens for every routed expert they go to (llama.cpp's mul_mat_id quantizes src1 once), each product reading the
rows it needs (csrc/gguf_q8.h's q8_round_rows / q8_rounded_matmul; MXFP4 weights through csrc/mxfp4_q8.h)."""
from __future__ import annotations

import torch

from strata.errors import ConfigError
from strata.kernels.cpu import cpu_kernels_apply
from strata.kernels.cpu import matmul as cpu_matmul


def check_int8_kernels(x: torch.Tensor) -> None:
    """ConfigError unless x's products can run the int8-activation C kernels (a C compiler, a CPU tensor)."""
    if not cpu_kernels_apply(x) or not cpu_matmul.available():
        raise ConfigError("quantized_activations='int8' runs on strata's CPU C kernels only (a C compiler and a CPU "
                          "tensor); use quantized_activations='float'", param="quantized_activations")


class RoundedRows:
    """x [T, K] rounded lazily, once per block size (32: Q8_0 / Q8_1 for the legacy kinds and MXFP4, 256: Q8_K for
    the K-quants); `product` multiplies some of its rows by one weight."""

    def __init__(self, x: torch.Tensor) -> None:
        check_int8_kernels(x)
        self.dtype, self.k = x.dtype, x.shape[-1]
        self.rows = cpu_matmul.float_rows(x)
        self._rounded: dict[int, torch.Tensor] = {}

    def rounded(self, per_block: int) -> torch.Tensor:
        if per_block not in self._rounded:
            self._rounded[per_block] = cpu_matmul.round_rows(self.rows, per_block)
        return self._rounded[per_block]

    def product(self, tokens: torch.Tensor | None, weight: torch.Tensor, kind: int, per_block: int, n: int,
                exps: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `tokens` (all when None) times the weight (`kind` as cpu_matmul.rounded_matmul takes it): [rows, n]
        in x's dtype."""
        ids = None if tokens is None else tokens.to(torch.int64).contiguous()
        y = cpu_matmul.rounded_matmul(self.rounded(per_block), self.k, ids, weight, kind, n, exps, bias)
        return y if self.dtype == torch.float32 else y.to(self.dtype)

"""The work of `strata bench embed` in floating-point operations (a BERT-shaped encoder: its linears per token, its
attention per sequence), and the float32 GEMM rate of torch.mm on the same threads, the ceiling its figures are read
against."""
from __future__ import annotations

import time
from typing import Any

import torch

# Encoders whose layers are BERT's: four [h, h] projections, an [h, intermediate] MLP up and down.
_BERT_TYPES = ("bert", "roberta", "xlm-roberta")


def encoder_flops(hf: Any, seq_lens: list[int]) -> float | None:
    """Multiply-adds x 2 of one pass over sequences of these lengths without padding; None for other models."""
    if hf.get("model_type") not in _BERT_TYPES:
        return None
    h, layers, intermediate = hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size
    linears = 2 * layers * (4 * h * h + 2 * h * intermediate) * sum(seq_lens)
    attention = 2 * 2 * layers * h * sum(n * n for n in seq_lens)  # q k^T, then the weights times v
    return float(linears + attention)


class GemmPeak:
    """torch.mm of two float32 squares: `seconds` is the best of a few products, `flops` one product's work."""

    def __init__(self, size: int = 2048) -> None:
        generator = torch.Generator().manual_seed(0)
        self.a, self.b = (torch.randn(size, size, generator=generator) for _ in range(2))
        self.flops = 2.0 * size ** 3
        torch.mm(self.a, self.b)  # warm-up: oneDNN / MKL pick their kernels

    def seconds(self, products: int = 3) -> float:
        best = float("inf")
        for _ in range(products):
            started = time.perf_counter()
            torch.mm(self.a, self.b)
            best = min(best, time.perf_counter() - started)
        return best

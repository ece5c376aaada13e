"""A linear layer's epilogue (its activation, or the residual added to its output) fused into oneDNN's GEMM on CPU.

An encoder's GELU and residual adds are separate passes over [tokens, 3072] and [tokens, 768] float32 outputs, about a
tenth of a BERT layer's time on 2 cores; oneDNN applies them to each output tile while it is in cache. Its float32
results equal the separate ops' bit for bit (tests/layers/test_linear_epilogue.py). Other layers (not packed for
oneDNN, quantized, with LoRA adapters, a few rows that the small-batch kernel takes) run the separate ops."""
from __future__ import annotations

from collections.abc import Callable

import torch

from strata.kernels.cpu.crossovers import SMALL_BATCH_DENSE
from strata.layers.linear import ColumnParallelLinear, PackableLinear, RowParallelLinear

# hidden_act -> oneDNN's post-op and its algorithm. Its tanh GELU differs from torch's by an ulp or two, so the tanh
# forms (gelu_new, gelu_pytorch_tanh) run apart.
_POST_OPS = {"gelu": ("gelu", "none"), "relu": ("relu", "")}


def _fuses(layer: PackableLinear, x: torch.Tensor) -> bool:
    weight = layer.weight
    return (layer.quant is None and layer.lora is None and weight.is_mkldnn and x.dtype == torch.float32
            and x.dim() == 2 and x.is_contiguous() and x.shape[0] > SMALL_BATCH_DENSE)


def activated_linear(layer: ColumnParallelLinear, x: torch.Tensor, hidden_act: str,
                     act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """act(layer(x)); `act` is `hidden_act`'s function, which runs apart where oneDNN does not fuse it."""
    if hidden_act not in _POST_OPS or not _fuses(layer, x):
        return act(layer(x))
    post_op, algorithm = _POST_OPS[hidden_act]
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, post_op, [], algorithm)


def residual_linear(layer: RowParallelLinear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x). Over TP ranks the residual, as the bias, joins the all-reduce's sum on rank 0 only."""
    if not (_fuses(layer, x) and layer.reduce_results and residual.is_contiguous()):
        return residual + layer(x)
    if layer.pc.tp_rank != 0:
        return layer(x)
    y = torch.ops.mkldnn._linear_pointwise.binary(x, residual, layer.weight, layer.bias, "add")
    return layer.pc.all_reduce(y)

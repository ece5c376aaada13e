"""Weights stored narrower than the activations: a bfloat16 checkpoint on a CPU without native bfloat16 arithmetic
computes in float32 while its linear weights and embedding tables stay bfloat16, so it holds the checkpoint's
memory, decode reads half the bytes of float32 (the small-batch kernel widens bfloat16 in registers) and larger
batches run oneDNN's float32 GEMM on float32 tiles widened one at a time."""
from __future__ import annotations

import torch
from torch import nn

from strata.layers.embedding import VocabParallelEmbedding
from strata.layers.linear import PackableLinear


def store_weights_as(model: nn.Module, dtype: torch.dtype) -> int:
    """Every plain float linear weight and embedding table of `model` converted to `dtype` (a tied LM head keeps
    sharing its table); quantized layers and everything else (norms, MoE experts, convolutions) stay as they are.
    Works on meta models too (`strata plan`). Returns the number of tensors converted."""
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if not isinstance(module, PackableLinear | VocabParallelEmbedding) or getattr(module, "quant", None):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.is_floating_point() or weight.dtype == dtype:
            continue
        if id(weight) not in converted:
            converted[id(weight)] = nn.Parameter(weight.data.to(dtype), requires_grad=False)
            converted[id(weight)].stored_narrow = True  # stays plain: oneDNN's packing would keep its dtype
        module.weight = converted[id(weight)]
    return len(converted)

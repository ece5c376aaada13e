"""Activations and residual adds fused into oneDNN's GEMM equal the separate ops bit for bit (float32)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.distributed import ParallelContext
from strata.layers import linear_epilogue
from strata.layers.linear import ColumnParallelLinear, RowParallelLinear, pack_linear_weights

_ACTS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def _layer(cls, packed: bool, in_features: int = 96, out_features: int = 160):
    layer = cls(in_features, out_features, ParallelContext(), bias=True)
    g = torch.Generator().manual_seed(in_features)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)
    layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))
    if packed:
        pack_linear_weights(layer)
        if not layer.weight.is_mkldnn:
            pytest.skip("oneDNN cannot pack weights on this machine")
    return layer


@pytest.mark.parametrize("hidden_act", sorted(_ACTS))
@pytest.mark.parametrize("rows,packed", [(70, True), (2, True), (70, False)])
def test_activated_linear_equals_the_activation_of_the_layer(hidden_act, rows, packed):
    """Many rows of a packed weight take the fused post-op; a few rows or a plain weight run the ops apart."""
    layer = _layer(ColumnParallelLinear, packed)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    act = _ACTS[hidden_act]
    assert torch.equal(linear_epilogue.activated_linear(layer, x, hidden_act, act), act(layer(x)))


@pytest.mark.parametrize("rows,packed", [(70, True), (2, True), (70, False)])
def test_residual_linear_equals_the_residual_plus_the_layer(rows, packed):
    layer = _layer(RowParallelLinear, packed, 160, 96)
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 160, generator=g), torch.randn(rows, 96, generator=g)
    assert torch.equal(linear_epilogue.residual_linear(layer, x, residual), residual + layer(x))

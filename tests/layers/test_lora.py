"""LoRA in the linear layers (strata/layers/lora.py), in float64: every row gets base(x) + scale * x A^T B^T of its
own slot's adapter (the base product alone for slot -1), whatever the mix of slots in the batch, for a fused q/k/v
projection (one A / B pair per projection), a merged gate/up and a row-parallel layer."""
from __future__ import annotations

import torch

from strata.distributed import ParallelContext
from strata.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from strata.layers.lora import LinearLoRA, LoRABatch, LoRAContext

F64 = torch.float64
ROW_SLOTS = [-1, 0, 1, 0, -1, 2, 2, 1]  # slot 0's rows are not contiguous, slot 2's are
SPANS = [(slot, row, row + 1) for row, slot in enumerate(ROW_SLOTS)]


def _attach(layer, num_blocks: int, context: LoRAContext, max_rank: int = 8) -> LinearLoRA:
    out, inp = layer.weight.shape
    layer.lora = LinearLoRA(3, max_rank, num_blocks, inp, out, context, F64)
    return layer.lora


def _random_layer(layer, g: torch.Generator):
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g, dtype=F64))
    return layer


def _expected(x, base, adapters, pieces):
    """Per row: base + scale * x A_j^T B_j^T for each projection j of the row's adapter, into its outputs."""
    want = base.clone()
    for row, slot in enumerate(ROW_SLOTS):
        if slot < 0:
            continue
        rank, scale, pairs = adapters[slot]
        for (a, b), (offset, size) in zip(pairs, pieces, strict=True):
            if a is not None:
                want[row, offset:offset + size] += scale * (x[row] @ a.T) @ b.T
    return want


def _adapters(g, pieces, in_features, skip=None):
    """Per slot: (rank, scale, [(A, B) or None per projection]), ranks and scales differing."""
    adapters = []
    for slot, (rank, scale) in enumerate([(4, 0.5), (8, 2.0), (2, 1.25)]):
        pairs = [(None, None) if (slot, j) == skip else
                 (torch.randn(rank, in_features, generator=g, dtype=F64),
                  torch.randn(size, rank, generator=g, dtype=F64)) for j, (_, size) in enumerate(pieces)]
        adapters.append((rank, scale, pairs))
    return adapters


def _load(lora, adapters, pieces):
    for slot, (rank, scale, pairs) in enumerate(adapters):
        for j, ((a, b), (offset, _)) in enumerate(zip(pairs, pieces, strict=True)):
            if a is not None:
                lora.set_block(slot, j, rank, a, [(offset, b)], scale)


def _check(layer, pieces, num_blocks, skip=None):
    g = torch.Generator().manual_seed(num_blocks)
    context = LoRAContext()
    lora = _attach(_random_layer(layer, g), num_blocks, context)
    in_features = layer.weight.shape[1]
    adapters = _adapters(g, pieces, in_features, skip)
    _load(lora, adapters, pieces)
    x = torch.randn(len(ROW_SLOTS), in_features, generator=g, dtype=F64)
    base = x @ layer.weight.T
    context.batch = LoRABatch.from_spans(SPANS, torch.device("cpu"))
    torch.testing.assert_close(layer(x), _expected(x, base, adapters, pieces), rtol=1e-12, atol=1e-12)
    context.batch = LoRABatch()  # no adapter rows: the base product, exactly
    assert torch.equal(layer(x), base)


def test_qkv_projection_adds_each_rows_adapter_per_projection():
    layer = QKVParallelLinear(24, 4, 4, 2, ParallelContext(), dtype=F64)
    q, k, v = layer.sizes
    _check(layer, [(0, q), (q, k), (q + k, v)], num_blocks=3)


def test_projection_an_adapter_leaves_alone_keeps_its_base_outputs():
    layer = QKVParallelLinear(24, 4, 4, 2, ParallelContext(), dtype=F64)
    q, k, v = layer.sizes
    _check(layer, [(0, q), (q, k), (q + k, v)], num_blocks=3, skip=(0, 1))  # slot 0 has no k_proj


def test_merged_gate_up_adds_each_rows_adapter():
    layer = MergedColumnParallelLinear(24, [20, 20], ParallelContext(), dtype=F64)
    _check(layer, [(0, 20), (20, 20)], num_blocks=2)


def test_row_parallel_projection_adds_each_rows_adapter():
    layer = RowParallelLinear(20, 24, ParallelContext(), dtype=F64)
    _check(layer, [(0, 24)], num_blocks=1)


def test_cleared_slot_adds_nothing():
    layer = RowParallelLinear(20, 24, ParallelContext(), dtype=F64)
    g = torch.Generator().manual_seed(0)
    context = LoRAContext()
    lora = _attach(_random_layer(layer, g), 1, context)
    lora.set_block(1, 0, 4, torch.randn(4, 20, generator=g, dtype=F64), [(0, torch.randn(24, 4, generator=g,
                                                                                        dtype=F64))], 1.0)
    lora.clear_slot(1)
    x = torch.randn(len(ROW_SLOTS), 20, generator=g, dtype=F64)
    context.batch = LoRABatch.from_spans(SPANS, torch.device("cpu"))
    assert torch.equal(layer(x), x @ layer.weight.T)

"""Routed experts kept in ggml blocks (strata/layers/quantization/gguf_experts.py) against transformers' Qwen3-MoE
block holding gguf-py's dequantized values of the same blocks: every type strata's dense GGUF layers read, gate, up and
down in one type or in several, one token (decode) and a batch; TP shards sum to the whole; a shard that would cut a
block is refused."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf_packing import F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, quantize, reference
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from strata.distributed import ParallelContext
from strata.errors import ConfigError
from strata.gguf.weights import GGUFTensor
from strata.layers.moe import DOWN, GATE, UP, FusedMoE, topk_softmax_routing
from strata.layers.quantization.gguf_experts import GGUFExpertsMethod, gguf_experts

E, TOP_K, H, I = 4, 2, 256, 512  # noqa: E741 - I: two K-quant blocks, so that TP=2 splits down at a block
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def random_blocks(kinds: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """Each projection of every expert as ggml rows uint8 [E, out, row_bytes] of its type."""
    rng = np.random.default_rng(seed)
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    return {p: np.stack([quantize(rng.normal(0, 0.1, shapes[p]).astype(np.float32), kinds[p]) for _ in range(E)])
            for p in PROJECTIONS}


def transformers_block(blocks: dict[str, np.ndarray], kinds: dict[str, int], router: torch.Tensor):
    """transformers' Qwen3-MoE block whose experts hold gguf-py's dequantized values of the blocks."""
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=TOP_K,
                            norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    values = {p: torch.from_numpy(np.stack([reference(b, kinds[p]) for b in blocks[p]])).float() for p in PROJECTIONS}
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(torch.cat([values["gate_proj"], values["up_proj"]], dim=1))
        block.experts.down_proj.copy_(values["down_proj"])
        block.gate.weight.copy_(router)
    return block


def strata_experts(blocks: dict[str, np.ndarray], kinds: dict[str, int], pc: ParallelContext) -> FusedMoE:
    """strata's Qwen3-MoE experts (softmax routing, renormalised; scores scale the outputs) loaded expert by expert
    from the blocks, as the GGUF reader hands them over."""
    routing = functools.partial(topk_softmax_routing, renormalize=True)
    moe = FusedMoE(E, TOP_K, H, I, pc, torch.float32, apply_router_weight_on_input=False, routing=routing)
    gguf_experts(moe, "experts", kinds)
    for e in range(E):
        for proj, shard, param in (("gate_proj", GATE, moe.gate_up_proj), ("up_proj", UP, moe.gate_up_proj),
                                   ("down_proj", DOWN, moe.down_proj)):
            rows = torch.from_numpy(blocks[proj][e].copy())
            shape = (H, I) if proj == "down_proj" else (I, H)
            param.weight_loader(param, GGUFTensor(rows, kinds[proj], shape), (e, shard))
    moe.quant.finish(moe)
    return moe


def uniform(kind: int) -> dict[str, int]:
    return dict.fromkeys(PROJECTIONS, kind)


# One type for all three (gate and up run as one product), and mixes (as Q4_K_M files store down in Q6_K; a layer
# whose gate and up stay float beside a quantized down).
KINDS = [uniform(k) for k in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)] + [
    {"gate_proj": Q4_K, "up_proj": Q8_0, "down_proj": Q6_K}, {"gate_proj": F32, "up_proj": F16, "down_proj": Q5_0}]


@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "-".join(str(v) for v in k.values()))
@pytest.mark.parametrize("tokens", [1, 37])
def test_blocked_experts_give_transformers_output_on_the_dequantized_weights(kinds, tokens):
    blocks = random_blocks(kinds, seed=tokens)
    torch.manual_seed(tokens)
    router, x = torch.randn(E, H) * 0.3, torch.randn(tokens, H)
    with torch.no_grad():
        expected = transformers_block(blocks, kinds, router)(x.unsqueeze(0))[0]
        got = strata_experts(blocks, kinds, ParallelContext())(x, torch.nn.functional.linear(x, router))
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()


def test_experts_stay_in_their_blocks():
    kinds = {"gate_proj": Q4_K, "up_proj": Q4_K, "down_proj": Q6_K}
    moe = strata_experts(random_blocks(kinds, seed=0), kinds, ParallelContext())
    assert isinstance(moe.quant, GGUFExpertsMethod)
    assert all(p.numel() == 0 for p in moe.parameters())  # placeholders: no float copy of any expert
    assert moe.expert_bytes == E * (2 * I * H // 256 * 144 + H * I // 256 * 210)


@pytest.mark.parametrize("kinds", [uniform(Q8_0), {"gate_proj": Q4_K, "up_proj": Q5_K, "down_proj": Q6_K}],
                         ids=["Q8_0", "K-quants"])
def test_tensor_parallel_shards_sum_to_the_whole(kinds):
    """Each rank keeps I/2 of gate's and of up's rows and I/2 of down's inputs, cut at whole blocks."""
    blocks = random_blocks(kinds, seed=3)
    x, logits = torch.randn(9, H), torch.randn(9, E)
    with torch.no_grad():
        whole = strata_experts(blocks, kinds, ParallelContext())(x, logits)
        parts = [strata_experts(blocks, kinds, ParallelContext(tp_rank=r, tp_size=2))(x, logits) for r in range(2)]
    assert (parts[0] + parts[1] - whole).abs().max().item() < 1e-4 * whole.abs().max().item()


def test_a_shard_that_cuts_a_block_is_refused():
    """TP=4 leaves 128 of down's 512 inputs on a rank: half a Q6_K block."""
    kinds = uniform(Q6_K)
    with pytest.raises(ConfigError, match=r"leaves 128 of the experts' 512 down_proj .* a Q6_K block of 256"):
        strata_experts(random_blocks(kinds, seed=0), kinds, ParallelContext(tp_rank=1, tp_size=4))

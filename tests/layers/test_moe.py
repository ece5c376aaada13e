"""Routed experts against transformers' Llama4TextMoe: routing, both checkpoint layouts, TP shards (gate and
up halves split separately), experts_int8 accuracy and memory, and the top-5 rule for int8 generation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llama4_checkpoints import TEXT_CONFIG, make_llama4_text, one_thread  # noqa: F401 (fixture)
from transformers import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

from strata import LLM, SamplingParams
from strata.distributed import ParallelContext
from strata.layers.moe import DOWN, GATE, UP, FusedMoE, quantize_rows_int8

pytestmark = pytest.mark.usefixtures("one_thread")
E, H, I = 4, 64, 32  # noqa: E741 - the spec's names


def hf_moe(top_k: int, seed: int = 0) -> Llama4TextMoe:
    torch.manual_seed(seed)
    moe = Llama4TextMoe(Llama4TextConfig(**{**TEXT_CONFIG, "num_experts_per_tok": top_k})).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe


def strata_experts(moe: Llama4TextMoe, top_k: int, pc: ParallelContext | None = None,
                   per_expert: bool = False, quantization: str | None = None,
                   dtype: torch.dtype = torch.float32) -> FusedMoE:
    experts = FusedMoE(E, top_k, H, I, pc or ParallelContext(), dtype, quantization)
    gate_up, down = moe.experts.gate_up_proj.data, moe.experts.down_proj.data
    if per_expert:  # the per-expert layout: [out, in] tensors, gate and up separate
        for e in range(E):
            experts.weight_loader(experts.gate_up_proj, gate_up[e, :, :I].T.contiguous(), (e, GATE))
            experts.weight_loader(experts.gate_up_proj, gate_up[e, :, I:].T.contiguous(), (e, UP))
            experts.weight_loader(experts.down_proj, down[e].T.contiguous(), (e, DOWN))
    else:
        experts.weight_loader(experts.gate_up_proj, gate_up)
        experts.weight_loader(experts.down_proj, down)
    return experts


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("per_expert", [False, True])
def test_routed_plus_shared_expert_match_transformers(top_k, per_expert):
    moe = hf_moe(top_k)
    x = torch.randn(37, H)
    with torch.no_grad():
        expected, _ = moe(x)
        routed = strata_experts(moe, top_k, per_expert=per_expert)(x, F.linear(x, moe.router.weight))
        got = routed + moe.shared_expert(x)
    assert (got - expected).abs().max().item() < 1e-5


def test_tensor_parallel_shards_sum_to_the_unsharded_output():
    """Each rank keeps I/2 of the gate rows and I/2 of the up rows; a contiguous split of 2I would pair
    gate with gate and fail."""
    moe = hf_moe(2, seed=1)
    x = torch.randn(11, H)
    logits = F.linear(x, moe.router.weight)
    with torch.no_grad():
        full = strata_experts(moe, 2)(x, logits)
        for per_expert in (False, True):
            parts = [strata_experts(moe, 2, ParallelContext(tp_rank=r, tp_size=2), per_expert)(x, logits)
                     for r in range(2)]
            assert parts[0].shape == full.shape
            assert (parts[0] + parts[1] - full).abs().max().item() < 1e-5


def test_int8_rows_reconstruct_within_half_a_step():
    w = torch.randn(48, 96) * torch.linspace(0.01, 3, 48).unsqueeze(1)
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8
    assert ((q.float() * scale.unsqueeze(1) - w).abs() <= scale.unsqueeze(1) / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_int8_output_is_close_and_half_the_memory(dtype):
    moe = hf_moe(1, seed=2)
    x = torch.randn(29, H)
    logits = F.linear(x, moe.router.weight)
    with torch.no_grad():
        ref = strata_experts(moe, 1, dtype=dtype)
        quant = strata_experts(moe, 1, quantization="experts_int8", dtype=dtype)
        a, b = ref(x.to(dtype), logits).float(), quant(x.to(dtype), logits).float()
    assert quant.gate_up_proj.dtype == torch.int8 and quant.down_proj.dtype == torch.int8
    assert (a - b).norm() / a.norm() < 0.03
    bf16_bytes = 3 * E * I * H * 2
    assert quant.expert_bytes <= 0.55 * bf16_bytes


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    # Weights of std 0.08: with 0.15 this random model is chaotic enough that bf16 rounding alone flips tokens.
    return make_llama4_text(tmp_path_factory.mktemp("llama4_moe"), interleave_moe_layer_step=1, seed=5, std=0.08,
                            dtype=torch.bfloat16)


def test_experts_int8_greedy_tokens_follow_the_top5_rule(moe_checkpoint):
    """vLLM's check_logprobs_close: where the sequences first differ, each token must be in the other
    model's top 5 at that position (after that they are not comparable)."""
    prompts = [{"prompt_token_ids": [11 + (7 * i + 3 * j) % 400 for j in range(n)]}
               for i, n in enumerate([4, 9, 15, 26, 33, 40, 7, 20])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = {}
    for quantization in (None, "experts_int8"):
        llm = LLM(str(moe_checkpoint), dtype="bfloat16", device="cpu", quantization=quantization)
        experts = llm.engine.executor.runner.model.expert_layers()
        outs[quantization] = (llm.generate(prompts, params, use_tqdm=False), sum(m.expert_bytes for m in experts))
        llm.shutdown()
    (ref, ref_bytes), (quant, quant_bytes) = outs[None], outs["experts_int8"]
    assert quant_bytes <= 0.55 * ref_bytes
    identical = 0
    for a, b in zip(ref, quant, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        identical += a.token_ids == b.token_ids
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta != tb:
                assert tb in a.logprobs[pos] and ta in b.logprobs[pos], f"position {pos}: {ta} vs {tb}"
                break
    assert identical >= len(prompts) // 2

"""Llama 4 text model against transformers' Llama4ForCausalLM: layer kinds, logits, greedy generation with
chunked prefill across attention chunks, both expert checkpoint layouts, PP stages chained in-process."""
from __future__ import annotations

import json
import random

import pytest
import torch
from llama4_checkpoints import TEXT_CONFIG, make_llama4_text, one_thread  # noqa: F401 (fixture)
from model_forward import strata_logits
from transformers import Llama4ForCausalLM as HFLlama4ForCausalLM
from transformers import Llama4TextConfig

from strata import LLM, SamplingParams
from strata.config import EngineConfig, HFConfig
from strata.distributed import ParallelContext
from strata.errors import ConfigError
from strata.executor.model_runner import ModelRunner
from strata.executor.step import NewRequestData, ScheduledRequest, SchedulerOutput
from strata.models.llama4 import layer_kind

# Scout-like: every layer MoE, top-1, qk-norm, llama3 RoPE. Maverick-like: dense/MoE interleaved, no qk-norm,
# plain RoPE. The top-2 variant checks that scores scale each chosen expert's input.
VARIANTS = {
    "mixed": {},
    "scout_like": dict(interleave_moe_layer_step=1,
                       rope_parameters={**TEXT_CONFIG["rope_parameters"], "high_freq_factor": 1.0}),
    "maverick_top2": dict(use_qk_norm=False, num_experts_per_tok=2, no_rope_layers=[1, 0, 1, 0],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    """Random non-special token ids; the longest spans several attention chunks (C = 8)."""
    rng = random.Random(seed)
    lengths = [3, 9, 17, 30][:n]
    return [[rng.randrange(11, 420) for _ in range(length)] for length in lengths]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(VARIANTS))
def text_checkpoint(request, tmp_path_factory):
    return make_llama4_text(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@pytest.fixture(scope="module")
def fused_and_per_expert(tmp_path_factory):
    """The same random weights saved once with fused [E, H, 2I] experts and once per expert."""
    return (make_llama4_text(tmp_path_factory.mktemp("fused"), seed=3),
            make_llama4_text(tmp_path_factory.mktemp("per_expert"), seed=3, per_expert=True))


def hf_model(path) -> HFLlama4ForCausalLM:
    return HFLlama4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: HFLlama4ForCausalLM, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("overrides", [
    {}, {"interleave_moe_layer_step": 1}, {"interleave_moe_layer_step": 3, "no_rope_layer_interval": 2},
    {"moe_layers": [0, 2], "no_rope_layers": [0, 1, 1, 0]}, {"no_rope_layers": []},
    {"attention_chunk_size": None, "use_qk_norm": False, "attn_temperature_tuning": False},
])
def test_layer_kinds_follow_transformers_derivation(overrides):
    hf = Llama4TextConfig(**{**TEXT_CONFIG, **overrides})
    ours = HFConfig({**TEXT_CONFIG, **overrides})
    for i in range(hf.num_hidden_layers):
        kind = layer_kind(ours, i)
        assert kind.moe == (i in hf.moe_layers)
        assert kind.use_rope == bool(hf.no_rope_layers[i])
        assert (kind.chunk_size is not None) == (hf.layer_types[i] == "chunked_attention")
        assert kind.qk_norm == (hf.use_qk_norm and bool(hf.no_rope_layers[i]))
        assert kind.temperature_tuning == (hf.attn_temperature_tuning and not hf.no_rope_layers[i])


def test_logits_match_transformers_within_1e4(text_checkpoint):
    hf = hf_model(text_checkpoint)
    for ids in prompts():
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        got = strata_logits(text_checkpoint, ids)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4


def test_greedy_tokens_match_transformers_with_chunked_prefill(text_checkpoint):
    hf = hf_model(text_checkpoint)
    # 5-token budget: prefill chunks straddle the 8-token attention chunks; decode runs past several more.
    llm = LLM(str(text_checkpoint), dtype="float32", device="cpu", max_num_batched_tokens=5, max_num_seqs=4,
              block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts(), outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 12)


def test_fused_and_per_expert_layouts_give_the_same_logits(fused_and_per_expert):
    fused, per_expert = fused_and_per_expert
    hf = hf_model(fused)
    ids = prompts()[-1]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    for path in (fused, per_expert):
        assert (strata_logits(path, ids) - expected).abs().max().item() < 1e-4


def test_pipeline_stages_chained_in_process_match_one_stage(fused_and_per_expert):
    """Each stage builds only its layers (global indices decide the layer kinds) and loads only its weights."""
    path = fused_and_per_expert[1]
    ids = prompts()[-1]
    full = strata_logits(path, ids)
    config = EngineConfig.create(str(path), dtype="float32", device="cpu")
    runners = [ModelRunner(config, ParallelContext(pp_rank=r, pp_size=2), torch.device("cpu")) for r in range(2)]
    assert "lm_head" in runners[0].model.missing_prefixes
    assert "model.embed_tokens" in runners[1].model.missing_prefixes
    step = SchedulerOutput([ScheduledRequest("r", ids, 0, list(range(8)), True,
                                             new=NewRequestData(SamplingParams(), ids))])
    hidden = None
    with torch.inference_mode():
        for runner in runners:
            runner.allocate_kv_cache(16)
            runner._update_states(step)
            input_ids, positions, meta = runner._prepare(step.requests)
            hidden = runner.model(input_ids, positions, meta, hidden)
        got = runners[1].model.compute_logits(hidden)
    assert (got - full).abs().max().item() < 1e-5


def test_experts_int8_is_refused_for_a_model_without_experts(llama_gqa, tmp_path):
    with pytest.raises(ConfigError, match="no MoE layers") as err:
        EngineConfig.create(str(llama_gqa), quantization="experts_int8", device="cpu")
    assert err.value.param == "quantization"
    dense = make_llama4_text(tmp_path / "dense", interleave_moe_layer_step=0, moe_layers=[])
    with pytest.raises(ConfigError, match="no MoE layers"):
        EngineConfig.create(str(dense), quantization="experts_int8", device="cpu")


def test_tensor_parallel_size_must_divide_expert_width(tmp_path):
    config = {**TEXT_CONFIG, "architectures": ["Llama4ForCausalLM"], "intermediate_size": 18}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="intermediate_size=18") as err:
        EngineConfig.create(str(tmp_path), tensor_parallel_size=4, device="cpu")
    assert err.value.param == "tensor_parallel_size"
    assert "1, 2" in err.value.message


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "experts_int8"])
def test_two_tensor_parallel_ranks_are_token_identical_to_one(fused_and_per_expert, quantization):
    """Attention heads, dense MLP, shared expert and both halves of every expert split over two processes."""
    path = fused_and_per_expert[1]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(tp: int) -> list[list[int]]:
        llm = LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=tp, quantization=quantization,
                  max_num_batched_tokens=7)
        try:
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()],
                                                                 params, use_tqdm=False)]
        finally:
            llm.shutdown()

    assert run(2) == run(1)

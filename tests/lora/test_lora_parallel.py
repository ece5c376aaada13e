"""LoRA on worker processes (CPU, gloo): TP=2 (column-parallel layers hold B's rows, row-parallel ones A's columns)
and PP=2 (each stage its layers' part of an adapter) give one process's greedy tokens and logprobs for a batch
mixing adapters and the base model, with more adapters than slots; a refusal on any rank reaches the caller."""
from __future__ import annotations

import pytest
from arch_checkpoints import random_prompts
from checkpoints import make_llama
from lora_checkpoints import make_adapter

from strata import LLM, LoRARequest, RequestError, SamplingParams

PROMPTS = random_prompts((9, 5, 7, 6), seed=3)
ENGINE = dict(dtype="float32", device="cpu", max_model_len=64, block_size=4, kv_cache_memory=1 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("lora_tp_llama"), vocab_size=320, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, intermediate_size=128, seed=11)


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory):
    shapes = [(8, 16, None), (4, 8, ["q_proj", "v_proj", "down_proj"]), (8, 12, ["k_proj", "o_proj", "up_proj"])]
    return [LoRARequest(f"l{i}", i + 1, str(make_adapter(base, tmp_path_factory.mktemp(f"lora_tp{i}"), r=r,
                                                         alpha=alpha, targets=targets, seed=20 + i)))
            for i, (r, alpha, targets) in enumerate(shapes)]


def _run(llm: LLM, loras: list[LoRARequest]) -> list:
    # Two adapters and the base model in one batch, then the third adapter (a slot and a host copy reused).
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                         lora_request=[loras[0], None, loras[1], loras[0]])
    third = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False, lora_request=loras[2])
    return mixed + third


@pytest.fixture(scope="module")
def expected(base, loras):
    with LLM(str(base), **ENGINE) as llm:
        return _run(llm, loras)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_parallel_layouts_give_one_process_tokens_with_adapters(base, loras, expected, layout):
    with LLM(str(base), **ENGINE, **layout) as llm:
        got = _run(llm, loras)
    assert len({tuple(o.outputs[0].token_ids) for o in expected[:3]}) == 3  # the adapters change the tokens
    for out, want in zip(got, expected, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        for position, wanted in zip(out.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            for token, logprob in position.items():
                assert abs(logprob.logprob - wanted[token].logprob) < 1e-4


def test_refusal_on_a_later_stage_reaches_the_caller(base, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_adapter(base, tmp_path / "head", r=4, targets=["q_proj"])
    path = folder / "adapter_model.safetensors"
    # The LM head, which only the last stage holds and no LoRA layer serves.
    save_file({k.replace("model.layers.1.self_attn.q_proj", "lm_head"): v for k, v in load_file(path).items()}, path)
    with LLM(str(base), **ENGINE, pipeline_parallel_size=2) as llm:
        with pytest.raises(RequestError, match="targets lm_head"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1), use_tqdm=False,
                         lora_request=LoRARequest("head", 9, str(folder)))
        assert not llm.engine.has_unfinished_requests()
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2  # the engine runs on

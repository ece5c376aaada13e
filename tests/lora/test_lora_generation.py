"""LLM(..., enable_lora=True) against PEFT (unmerged PeftModel, full forward passes): greedy tokens and logprobs of
each adapter (ranks, alphas, targets, rsLoRA on and off) on random Llama and Qwen3 bases; a batch mixing three
adapters and the base model (more adapters than max_loras, the same prompt for all: the prefix cache must keep them
apart; chunked prefill, preemption) gives each request what it gets alone; bad adapters are refused up front."""
from __future__ import annotations

import pytest
from arch_checkpoints import assert_matches_transformers, make_arch, random_prompts
from checkpoints import make_llama
from lora_checkpoints import edit_adapter_config, make_adapter, peft_greedy

from strata import LLM, LoRARequest, RequestError, SamplingParams

MAX_TOKENS = 6
PROMPTS = random_prompts((19, 7))
# (rank, alpha, rsLoRA, targets) of each adapter of the Llama base.
ADAPTERS = {
    "all": (8, 16, False, None),
    "qv_down": (4, 8, True, ["q_proj", "v_proj", "down_proj"]),
    "k_o_gate_up": (16, 12, False, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("lora_llama"))


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    return {name: make_adapter(llama, tmp_path_factory.mktemp(f"lora_{name}"), r=r, alpha=alpha, rslora=rslora,
                               targets=targets, seed=i)
            for i, (name, (r, alpha, rslora, targets)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def llm(llama):
    # Blocks of 4 tokens, 16 tokens a step (prompts prefill in chunks), room for about three requests' blocks (five
    # at once preempt), 2 slots and 2 adapters in host memory for 3 adapters (both reused LRU).
    llm = LLM(str(llama), dtype="float32", device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=40 * 1024, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    yield llm
    llm.shutdown()


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def _generate(llm, prompts, lora):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_matches_peft(llm, llama, adapters, name):
    outputs = _generate(llm, PROMPTS, _requests(adapters)[name])
    assert_matches_transformers(outputs, peft_greedy(llama, adapters[name], PROMPTS, MAX_TOKENS))


def test_mixed_batch_gives_each_request_what_it_gets_alone(llm, llama, adapters):
    loras = _requests(adapters)
    mix = [loras["all"], None, loras["qv_down"], loras["k_o_gate_up"], loras["all"], None]
    prompt = PROMPTS[0]  # one prompt for all: only the adapter tells their KV blocks apart
    alone = {name: _generate(llm, [prompt], lora)[0] for name, lora in [*loras.items(), ("base", None)]}
    assert all(alone[name].outputs[0].token_ids != alone["base"].outputs[0].token_ids for name in loras)
    preemptions = llm.engine.snapshot()["num_preemptions"]
    mixed = _generate(llm, [prompt] * len(mix), mix)
    assert llm.engine.snapshot()["num_preemptions"] > preemptions  # the batch ran out of blocks on the way
    for out, lora in zip(mixed, mix, strict=True):
        want = alone["base" if lora is None else lora.lora_name].outputs[0]
        assert out.outputs[0].token_ids == want.token_ids
        for got, expected in zip(out.outputs[0].logprobs, want.logprobs, strict=True):
            for token, logprob in got.items():
                assert abs(logprob.logprob - expected[token].logprob) < 1e-5
    # And the base rows are the base model's own.
    assert_matches_transformers([mixed[1]], peft_greedy(llama, None, [prompt], MAX_TOKENS))


def test_qwen3_adapter_matches_peft(tmp_path):
    base = make_arch(tmp_path / "qwen3", "qwen3")
    adapter = make_adapter(base, tmp_path / "adapter", r=8, alpha=32, rslora=True, seed=3)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=8)
    try:
        outputs = _generate(llm, PROMPTS, LoRARequest("q", 7, str(adapter)))
    finally:
        llm.shutdown()
    assert_matches_transformers(outputs, peft_greedy(base, adapter, PROMPTS, MAX_TOKENS))


@pytest.mark.parametrize("change, reason", [
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias"),
    (dict(r=32), "above max_lora_rank=16"),
])
def test_unsupported_adapter_is_refused_before_it_is_queued(llm, llama, tmp_path, change, reason):
    folder = make_adapter(llama, tmp_path / "bad", r=4)
    edit_adapter_config(folder, **change)
    with pytest.raises(RequestError, match=reason):
        _generate(llm, PROMPTS[:1], LoRARequest("bad", 99, str(folder)))
    assert not llm.engine.has_unfinished_requests()


def test_adapter_of_a_module_lora_does_not_serve_is_refused(llm, llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_adapter(llama, tmp_path / "other", r=4, targets=["q_proj"])
    path = folder / "adapter_model.safetensors"
    # A module of the base that no LoRA layer serves (the LM head).
    save_file({k.replace("model.layers.1.self_attn.q_proj", "lm_head"): v for k, v in load_file(path).items()}, path)
    with pytest.raises(RequestError, match="targets lm_head"):
        _generate(llm, PROMPTS[:1], LoRARequest("head", 98, str(folder)))


def test_adapter_holding_a_copy_of_a_base_module_is_refused(llm, llama, tmp_path):
    folder = make_adapter(llama, tmp_path / "head", r=4, targets=["q_proj", "lm_head"])  # saves lm_head's weight
    with pytest.raises(RequestError, match="lm_head.base_layer.weight is not a LoRA A or B weight"):
        _generate(llm, PROMPTS[:1], LoRARequest("head", 97, str(folder)))


def test_lora_request_without_enable_lora_is_refused(llama, adapters):
    llm = LLM(str(llama), dtype="float32", device="cpu", max_model_len=64)
    try:
        with pytest.raises(RequestError, match="without enable_lora"):
            _generate(llm, PROMPTS[:1], LoRARequest("all", 1, str(adapters["all"])))
    finally:
        llm.shutdown()

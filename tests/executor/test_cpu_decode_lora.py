"""Decode steps with LoRA adapter rows on the fused CPU decode path (each projection's shrink and expand in C): a
batch mixing two adapters of different ranks and the base model stays on the whole-step path and gives PEFT's greedy
tokens and logprobs (unmerged adapters, full forward passes), and the modules' path's (each projection's delta
beside its module)."""
from __future__ import annotations

import pytest
from arch_checkpoints import assert_matches_transformers, random_prompts
from checkpoints import make_llama
from lora_checkpoints import make_adapter, peft_greedy

from strata import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 5
PROMPTS = random_prompts((9, 5, 7))  # three rows: the most the fused path takes on oneDNN-packed float32 weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = make_llama(tmp_path_factory.mktemp("fused_lora_llama"))
    adapters = {"r4": make_adapter(base, tmp_path_factory.mktemp("r4"), r=4, alpha=8, seed=1),
                "r16": make_adapter(base, tmp_path_factory.mktemp("r16"), r=16, alpha=12, seed=2,
                                    targets=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])}
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=2,
              max_lora_rank=16)
    yield base, adapters, llm
    llm.shutdown()


def _generate(llm, loras):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=loras)


def test_mixed_adapter_decode_batch_runs_fused_and_matches_peft(setup):
    base, adapters, llm = setup
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    loras = [requests["r4"], None, requests["r16"]]
    backend = llm.engine.executor.runner.cpu_decode
    before, adapter_steps = backend.served["whole step"], backend.adapter_steps
    outputs = _generate(llm, loras)
    # Every decode step had adapter rows, and each after the prompts' took the whole-step call.
    assert backend.served["whole step"] - before >= MAX_TOKENS - 1
    assert backend.adapter_steps - adapter_steps == backend.served["whole step"] - before
    for out, lora, prompt in zip(outputs, loras, PROMPTS, strict=True):
        adapter = None if lora is None else adapters[lora.lora_name]
        assert_matches_transformers([out], peft_greedy(base, adapter, [prompt], MAX_TOKENS))


def test_fused_and_modules_paths_agree_on_adapter_rows(setup):
    _, adapters, llm = setup
    r4, r16 = (LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items()))
    loras = [r16, r4, r16]
    fused = _generate(llm, loras)
    runner = llm.engine.executor.runner
    backend, runner.cpu_decode = runner.cpu_decode, None  # every step through the modules
    try:
        torch_path = _generate(llm, loras)
    finally:
        runner.cpu_decode = backend
    for a, b in zip(fused, torch_path, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)

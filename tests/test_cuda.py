"""The same code on CUDA: greedy tokens equal the CPU's (skipped without a GPU)."""
from __future__ import annotations

import pytest

from strata import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_cuda_greedy_tokens_equal_cpu(llama_gqa):
    prompts = ["def add(a, b):", "The quick brown fox", "import os"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(str(llama_gqa), device="cpu").generate(prompts, params)]
    cuda = [o.outputs[0].token_ids for o in LLM(str(llama_gqa), device="cuda", dtype="float32",
                                                 gpu_memory_utilization=0.3).generate(prompts, params)]
    assert cuda == cpu


def test_cuda_seeded_sampling_is_batch_independent(llama_gqa):
    llm = LLM(str(llama_gqa), device="cuda", gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    alone = llm.generate("hello", params)[0].outputs[0].token_ids
    batched = llm.generate(["hello", "other", "third"], params)[0].outputs[0].token_ids
    assert alone == batched

"""The same requests give the same tokens however they are batched, chunked or preempted."""
from __future__ import annotations

import pytest

from strata import LLM, SamplingParams

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import os",
    "Once upon a time",
    "class Engine:\n    def step(self):\n        pass\n\nclass Scheduler:",
    "x",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(llm: LLM, params: SamplingParams | list[SamplingParams], one_at_a_time: bool = False) -> list[list[int]]:
    if one_at_a_time:
        per = params if isinstance(params, list) else [params] * len(PROMPTS)
        return [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, per,
                                                                                               strict=True)]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llama_gqa):
    llm = LLM(str(llama_gqa), enable_prefix_caching=False)
    return {"greedy": run(llm, GREEDY, one_at_a_time=True)}


def test_all_batched_equals_one_at_a_time(llama_gqa, reference):
    llm = LLM(str(llama_gqa), enable_prefix_caching=False)
    assert run(llm, GREEDY) == reference["greedy"]


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_chunked_prefill_gives_identical_tokens(llama_gqa, reference, budget):
    llm = LLM(str(llama_gqa), max_num_batched_tokens=budget, max_num_seqs=budget, enable_prefix_caching=False)
    assert run(llm, GREEDY) == reference["greedy"]


def test_preemption_happens_and_gives_identical_tokens(llama_gqa, reference):
    # 10 blocks of 16 tokens (one 160-token sequence): six requests cannot all stay resident.
    llm = LLM(str(llama_gqa), max_model_len=160, enable_prefix_caching=False,
              kv_cache_memory=10 * llm_block_bytes(llama_gqa))
    assert run(llm, GREEDY) == reference["greedy"]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.pool.num_free == llm.engine.scheduler.kv.pool.num_blocks


def llm_block_bytes(path) -> int:
    # 2 layers x (K and V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes
    return 2 * 2 * 16 * 2 * 16 * 4


def test_seeded_sampling_is_identical_alone_and_in_a_batch(llama_gqa):
    llm = LLM(str(llama_gqa))
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(PROMPTS))]
    alone = run(llm, seeded, one_at_a_time=True)
    batched = run(llm, seeded)
    assert alone == batched
    # Mixed with unseeded requests and a different batch composition: still the same.
    mixed_params = seeded[:3] + [SamplingParams(temperature=1.0, max_tokens=20)] * 3
    mixed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, mixed_params, use_tqdm=False)]
    assert mixed[:3] == alone[:3]
    assert len({tuple(t) for t in alone}) > 1


def test_seeded_sampling_survives_preemption(llama_gqa):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    big = LLM(str(llama_gqa), enable_prefix_caching=False)
    small = LLM(str(llama_gqa), max_model_len=160, enable_prefix_caching=False,
                kv_cache_memory=10 * llm_block_bytes(llama_gqa))
    assert run(small, seeded) == run(big, seeded)
    assert small.engine.scheduler.num_preemptions > 0

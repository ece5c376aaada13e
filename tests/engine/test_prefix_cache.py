"""Prefix caching: repeated prompts reuse full blocks, outputs do not change, nothing leaks."""
from __future__ import annotations

import random

from strata import LLM, SamplingParams
from strata.engine.kv_cache import KVCacheManager
from strata.engine.request import Request

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_repeated_long_prompt_is_served_from_cache_with_identical_output(llama_gqa):
    llm = LLM(str(llama_gqa))
    uncached = LLM(str(llama_gqa), enable_prefix_caching=False)
    prompt = {"prompt_token_ids": [random.Random(0).randrange(2, 250) for _ in range(100)]}
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    kv = llm.engine.scheduler.kv
    hits_before = kv.prefix_hits
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    # 100 tokens = 6 full blocks of 16; all of them are reused.
    assert kv.prefix_hits - hits_before == 96
    assert second.num_cached_tokens == 96
    assert first.num_cached_tokens == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert uncached.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_no_block_is_leaked_after_500_requests(llama_gqa):
    llm = LLM(str(llama_gqa), max_model_len=128, kv_cache_memory=64 * 8192)
    rng = random.Random(1)
    shared = [rng.randrange(2, 250) for _ in range(40)]
    prompts = [{"prompt_token_ids": shared[: rng.randrange(1, 40)] + [rng.randrange(2, 250)
                                                                   for _ in range(rng.randrange(1, 30))]}
               for _ in range(500)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 6), ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(count == 0 for count in pool.ref_count)
    assert llm.engine.scheduler.kv.prefix_hits > 0


def test_blocks_shared_by_two_live_requests_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Request("a", list(range(10)), GREEDY, 64)
    kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    b = Request("b", list(range(9)) + [99], GREEDY, 64)
    hit = kv.computed_blocks(b)
    assert hit == a.block_ids[:2]
    assert kv.allocate(b, 2, hit)
    assert kv.pool.ref_count[hit[0]] == 2
    kv.free(a)
    assert kv.pool.ref_count[hit[0]] == 1 and hit[0] not in kv.pool.free
    kv.free(b)
    assert kv.pool.num_free == 8

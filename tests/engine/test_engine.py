"""Engine life cycle: aborting frees blocks at once; requests join and leave a running batch."""
from __future__ import annotations

import pytest

from strata import LLM, RequestError, SamplingParams


def test_abort_mid_generation_frees_every_block(llama_gqa):
    engine = LLM(str(llama_gqa), enable_prefix_caching=False).engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(5, 40 + i))}, params)
    for _ in range(3):
        engine.step()
    pool = engine.scheduler.kv.pool
    assert pool.num_free < pool.num_blocks
    for i in range(4):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    assert pool.num_free == pool.num_blocks


def test_requests_join_a_running_batch_and_get_the_tokens_they_get_alone(llama_gqa):
    llm = LLM(str(llama_gqa))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("late joiner", params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("early", "an early request", params)
    engine.step()
    engine.step()
    engine.add_request("late", "late joiner", params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["late"].outputs[0].token_ids == alone


def test_duplicate_request_ids_are_refused(llama_gqa):
    engine = LLM(str(llama_gqa)).engine
    engine.add_request("same", "a", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError) as refused:
        engine.add_request("same", "b", SamplingParams(max_tokens=2))
    assert refused.value.param == "request_id"

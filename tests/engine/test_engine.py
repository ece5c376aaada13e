"""Engine life cycle: prompts processed once on the way in; aborting frees blocks at once; requests join and
leave a running batch; the snapshot the server reads."""
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


class _CountingTokenizer:
    """The engine's tokenizer, counting how often text is encoded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_prompt_is_tokenized_once_and_reaches_the_scheduler_unchanged(llama_gqa):
    engine = LLM(str(llama_gqa)).engine
    engine.input.tokenizer = counting = _CountingTokenizer(engine.input.tokenizer)
    prompt = engine.process_prompt("tokenized only here")
    assert counting.calls == 1 and prompt.text == "tokenized only here"
    engine.add_request("once", prompt, SamplingParams(max_tokens=2))
    assert counting.calls == 1
    assert engine.scheduler.requests["once"].prompt_token_ids == prompt.token_ids


def test_process_prompt_truncates_before_validating(llama_gqa):
    engine = LLM(str(llama_gqa), max_model_len=16).engine
    ids = list(range(5, 45))
    with pytest.raises(RequestError):
        engine.process_prompt({"prompt_token_ids": ids})
    assert engine.process_prompt(ids, truncate_prompt_tokens=4).token_ids == ids[-4:]
    assert engine.process_prompt(ids, truncate_prompt_tokens=4, truncation_side="right").token_ids == ids[:4]
    with pytest.raises(RequestError):
        engine.process_prompt(ids, truncate_prompt_tokens=-1)  # the whole context leaves nothing to generate


def test_snapshot_reports_the_kv_pool_and_token_counters(llama_gqa):
    engine = LLM(str(llama_gqa), enable_prefix_caching=False).engine
    engine.add_request("r", {"prompt_token_ids": list(range(5, 30))}, SamplingParams(max_tokens=3))
    engine.step()
    snap = engine.snapshot()
    assert snap["running"] == 1 and snap["waiting"] == 0
    assert 0 < snap["free_blocks"] < snap["total_blocks"] and snap["kv_usage"] > 0
    assert snap["generation_tokens"] == 1 and snap["steps"] == 1

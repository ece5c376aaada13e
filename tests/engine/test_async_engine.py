"""AsyncEngine's threads: the core is stepped on one thread and its outputs processed on another; a stop string found
there finishes the request in the core exactly once, and what the core made meanwhile never reaches the output."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from transformers import AutoTokenizer

from strata import SamplingParams
from strata.config import EngineConfig
from strata.engine.async_engine import AsyncEngine

PROMPT = "def add"


@pytest.fixture(scope="module")
def engine(llama_gqa):
    eng = AsyncEngine.from_config(EngineConfig.create(str(llama_gqa), max_model_len=128, kv_cache_memory=1 << 20))
    yield eng
    eng.shutdown()


def generate(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list:
    async def collect() -> list:
        return [out async for out in engine.generate(request_id, PROMPT, params)]

    return asyncio.run(collect())


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_outputs_are_processed_on_a_thread_other_than_the_step_loops(engine):
    step_threads, output_threads = set(), set()
    step, process = engine.core.step, engine.output.process_outputs

    def recorded_step():
        step_threads.add(threading.get_ident())
        return step()

    def recorded_process(outputs):
        output_threads.add(threading.get_ident())
        return process(outputs)

    engine.core.step, engine.output.process_outputs = recorded_step, recorded_process
    try:
        outs = generate(engine, "threads", greedy(max_tokens=5))
    finally:
        del engine.core.step, engine.output.process_outputs
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert len(step_threads) == 1 and len(output_threads) == 1 and step_threads != output_threads
    assert threading.get_ident() not in step_threads | output_threads


def stop_string_at(tokenizer, ids: list[int]) -> tuple[int, str]:
    """A token index k >= 3 and a short stop string that first appears at the end of the text of ids[:k + 1]."""
    for k in range(3, len(ids) - 12):
        text = tokenizer.decode(ids[:k + 1])
        for length in (1, 2, 3):
            stop = text[-length:]
            if "\ufffd" not in text and stop.isascii() and stop.strip() and text.find(stop) == len(text) - length:
                return k, stop
    raise AssertionError("no usable stop string in the greedy output")


def test_a_stop_string_finishes_the_request_in_the_core_once_and_later_tokens_never_reach_the_output(
        engine, llama_gqa):
    tokenizer = AutoTokenizer.from_pretrained(llama_gqa)
    full = generate(engine, "full", greedy(max_tokens=40))[-1].outputs[0].token_ids
    k, stop = stop_string_at(tokenizer, full)
    made, finishes = [], []
    ran_ahead = threading.Event()
    step, process, finish = engine.core.step, engine.output.process_outputs, engine.core.finish_requests

    def counting_step():
        outputs = step()
        made.extend(t for out in outputs if out.request_id == "s" for t in out.new_token_ids)
        if len(made) > k + 4:
            ran_ahead.set()
        return outputs

    def held_process(outputs):
        ran_ahead.wait(timeout=60)  # the core runs on past the stop string before any output is processed
        return process(outputs)

    def recorded_finish(ids, *args):
        finishes.append(list(ids))
        return finish(ids, *args)

    engine.core.step, engine.output.process_outputs, engine.core.finish_requests = (
        counting_step, held_process, recorded_finish)
    before = engine.stats()["generation_tokens"]
    try:
        out = generate(engine, "s", greedy(max_tokens=40, stop=[stop]))[-1].outputs[0]
        deadline = time.monotonic() + 30
        while "s" in engine.core.scheduler.requests and time.monotonic() < deadline:
            time.sleep(0.01)  # the finish travels back to the core thread through the command queue
    finally:
        del engine.core.step, engine.output.process_outputs, engine.core.finish_requests
    assert ran_ahead.is_set() and len(made) > len(out.token_ids)
    assert finishes == [["s"]] and "s" not in engine.core.scheduler.requests
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    decoded = tokenizer.decode(full[:k + 1])
    assert out.token_ids == full[:k + 1] and out.text == decoded[:decoded.find(stop)]
    assert engine.stats()["generation_tokens"] - before == len(out.token_ids)

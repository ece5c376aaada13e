"""The scheduler and the prefix cache with LoRA requests (no model): the running requests never use more adapters
than max_loras (a request of another adapter waits, those behind it go first), and requests of different adapters
never share cached KV blocks."""
from __future__ import annotations

from strata.config import SchedulerConfig
from strata.engine.kv_cache import KVCacheManager
from strata.engine.request import Request, RequestStatus
from strata.engine.scheduler import Scheduler
from strata.lora.request import LoRARequest
from strata.sampling_params import SamplingParams

PROMPT = list(range(10, 30))
A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")


def _request(request_id: str, lora: LoRARequest | None) -> Request:
    return Request(request_id, PROMPT, SamplingParams(max_tokens=4), 100, lora_request=lora)


def test_request_of_an_adapter_beyond_max_loras_waits_and_those_behind_it_run():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=1000), KVCacheManager(64, 4), max_loras=1)
    for request_id, lora in [("a1", A), ("b1", B), ("base", None), ("a2", A)]:
        scheduler.add(_request(request_id, lora))
    out = scheduler.schedule()
    assert [s.request_id for s in out.requests] == ["a1", "base", "a2"]
    assert [s.new.lora_request for s in out.requests] == [A, None, A]
    assert [r.request_id for r in scheduler.waiting] == ["b1"]
    scheduler.finish(scheduler.requests["a1"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish(scheduler.requests["a2"], RequestStatus.FINISHED_ABORTED)
    for r in scheduler.running:
        r.in_flight = False
    assert "b1" in [s.request_id for s in scheduler.schedule().requests]  # adapter a no longer runs


def test_requests_of_different_adapters_do_not_share_cached_blocks():
    kv = KVCacheManager(64, 4)
    first = _request("a", A)
    assert kv.allocate(first, len(PROMPT))
    first.num_computed_tokens = len(PROMPT)
    kv.cache_full_blocks(first)
    assert kv.computed_blocks(_request("a again", A))  # the same adapter shares the prompt's blocks
    assert kv.computed_blocks(_request("b", B)) == []
    assert kv.computed_blocks(_request("base", None)) == []

"""The scheduler on its own (no engine, no model): the token stop rules in their order of precedence, and a step's
update that ends requests on EOS, stop tokens and length, frees them at once, and keeps accepted draft tokens after
a stop token out of the request."""
from __future__ import annotations

import pytest

from strata.config import SchedulerConfig
from strata.engine.kv_cache import KVCacheManager
from strata.engine.request import Request, RequestStatus
from strata.engine.scheduler import Scheduler, check_stop
from strata.executor.model_runner import RunnerOutput
from strata.sampling_params import SamplingParams

EOS = 2
PROMPT = [10, 11, 12]


def request_after(outputs: list[int], max_model_len: int = 100, **kw) -> Request:
    params = SamplingParams(**kw)
    params.all_stop_token_ids = {EOS}
    request = Request("r", PROMPT, params, max_model_len)
    request.token_ids.extend(outputs)
    return request


def test_an_ordinary_token_does_not_stop():
    assert check_stop(request_after([5])) is None


def test_eos_stops_without_a_stop_reason():
    assert check_stop(request_after([5, EOS])) == (RequestStatus.FINISHED_STOPPED, None)


def test_ignore_eos_keeps_generating():
    assert check_stop(request_after([EOS], ignore_eos=True)) is None


def test_a_stop_token_id_stops_and_is_the_stop_reason():
    assert check_stop(request_after([7], stop_token_ids=[7])) == (RequestStatus.FINISHED_STOPPED, 7)


def test_eos_listed_as_stop_token_id_reports_eos_first():
    assert check_stop(request_after([EOS], stop_token_ids=[EOS])) == (RequestStatus.FINISHED_STOPPED, None)


def test_stop_tokens_wait_for_min_tokens():
    assert check_stop(request_after([EOS], min_tokens=2)) is None
    assert check_stop(request_after([7], min_tokens=2, stop_token_ids=[7])) is None
    assert check_stop(request_after([5, 7], min_tokens=2, stop_token_ids=[7])) == (RequestStatus.FINISHED_STOPPED, 7)


def test_max_tokens_and_context_length_stop_with_length():
    assert check_stop(request_after([5, 6], max_tokens=2)) == (RequestStatus.FINISHED_LENGTH, None)
    assert check_stop(request_after([5, 6], max_model_len=5)) == (RequestStatus.FINISHED_LENGTH, None)


def test_a_stop_token_wins_over_length_in_the_same_token():
    assert check_stop(request_after([5, 7], max_tokens=2, stop_token_ids=[7])) == (RequestStatus.FINISHED_STOPPED, 7)


class _Drafts:
    """A speculative decoder that proposes a fixed draft to every decoding request."""

    def __init__(self, draft: list[int]) -> None:
        self.draft, self.finished = draft, []

    def drafts(self, decoding: list[Request], num_running: int) -> dict[str, list[int]]:
        return {r.request_id: list(self.draft) for r in decoding}

    def record(self, drafted: int, accepted: int) -> None:
        pass

    def finish(self, request: Request) -> None:
        self.finished.append(request.request_id)


def scheduler_with(request: Request, spec: _Drafts | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_model_len=request.max_model_len), kv, spec=spec)
    scheduler.add(request)
    return scheduler


def step(scheduler: Scheduler, sampled: list[int]):
    sched = scheduler.schedule()
    (scheduled,) = sched.requests
    return scheduled, scheduler.update(sched, RunnerOutput(sampled={scheduled.request_id: sampled}))


@pytest.mark.parametrize("params, max_model_len, tokens, status, stop_reason", [
    ({}, 100, [5, EOS], RequestStatus.FINISHED_STOPPED, None),
    ({"stop_token_ids": [7]}, 100, [5, 7], RequestStatus.FINISHED_STOPPED, 7),
    ({"max_tokens": 2}, 100, [5, 6], RequestStatus.FINISHED_LENGTH, None),
    ({"max_tokens": 50}, len(PROMPT) + 2, [5, 6], RequestStatus.FINISHED_LENGTH, None),
], ids=["eos", "stop_token", "max_tokens", "max_model_len"])
def test_the_scheduler_finishes_a_request_and_frees_its_blocks_in_the_same_update(params, max_model_len, tokens,
                                                                                  status, stop_reason):
    sampling = SamplingParams(**params)
    sampling.all_stop_token_ids = {EOS}
    request = Request("r", PROMPT, sampling, max_model_len)
    scheduler = scheduler_with(request)
    pool = scheduler.kv.pool
    _, (first,) = step(scheduler, [tokens[0]])
    assert first.new_token_ids == [tokens[0]] and not first.finished
    assert pool.num_free < pool.num_blocks and request in scheduler.running
    _, (last,) = step(scheduler, [tokens[1]])
    assert (last.new_token_ids, last.finish_status, last.stop_reason) == ([tokens[1]], status, stop_reason)
    assert last.stopped_on_token is (status is RequestStatus.FINISHED_STOPPED)
    assert request.status is status and request.token_ids == PROMPT + tokens
    assert pool.num_free == pool.num_blocks and not scheduler.running and "r" not in scheduler.requests
    assert scheduler.schedule().finished_request_ids == ["r"]  # the workers hear of it with the next step


def test_accepted_draft_tokens_after_a_stop_token_are_not_appended():
    sampling = SamplingParams(max_tokens=50, stop_token_ids=[7])
    sampling.all_stop_token_ids = {EOS}
    request = Request("r", PROMPT, sampling, 100)
    spec = _Drafts([5, 7, 8])
    scheduler = scheduler_with(request, spec)
    step(scheduler, [4])  # the prefill samples the first token
    scheduled, (out,) = step(scheduler, [5, 7, 8, 9])  # every draft accepted, and one more token
    assert scheduled.num_draft_tokens == 3
    assert out.new_token_ids == [5, 7] and (out.finish_status, out.stop_reason) == (RequestStatus.FINISHED_STOPPED, 7)
    assert request.token_ids == PROMPT + [4, 5, 7]
    assert spec.finished == ["r"] and scheduler.kv.pool.num_free == scheduler.kv.pool.num_blocks


def test_length_ends_a_request_inside_its_accepted_drafts():
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    sampling.all_stop_token_ids = {EOS}
    request = Request("r", PROMPT, sampling, 100)
    scheduler = scheduler_with(request, _Drafts([5]))
    step(scheduler, [4])
    _, (out,) = step(scheduler, [5, EOS])
    assert out.new_token_ids == [5, EOS] and out.finish_status is None
    _, (out,) = step(scheduler, [6, 6])
    assert out.new_token_ids == [6] and out.finish_status is RequestStatus.FINISHED_LENGTH
    assert request.token_ids == PROMPT + [4, 5, EOS, 6]

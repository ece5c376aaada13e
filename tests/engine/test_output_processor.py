"""Stop conditions, all decided in one place, in their order of precedence."""
from __future__ import annotations

from strata.engine.output_processor import stop_condition
from strata.engine.request import Request, RequestStatus
from strata.sampling_params import SamplingParams

EOS = 2


def request_after(outputs: list[int], max_model_len: int = 100, **kw) -> Request:
    params = SamplingParams(**kw)
    params.all_stop_token_ids = {EOS}
    request = Request("r", [10, 11, 12], params, max_model_len)
    request.token_ids.extend(outputs)
    return request


def test_an_ordinary_token_does_not_stop():
    assert stop_condition(request_after([5]), None) is None


def test_eos_stops_without_a_stop_reason():
    assert stop_condition(request_after([5, EOS]), None) == (RequestStatus.FINISHED_STOPPED, None)


def test_ignore_eos_keeps_generating():
    assert stop_condition(request_after([EOS], ignore_eos=True), None) is None


def test_a_stop_token_id_stops_and_is_the_stop_reason():
    assert stop_condition(request_after([7], stop_token_ids=[7]), None) == (RequestStatus.FINISHED_STOPPED, 7)


def test_eos_listed_as_stop_token_id_reports_eos_first():
    assert stop_condition(request_after([EOS], stop_token_ids=[EOS]), None) == (RequestStatus.FINISHED_STOPPED, None)


def test_stop_tokens_wait_for_min_tokens_but_stop_strings_do_not():
    assert stop_condition(request_after([EOS], min_tokens=2), None) is None
    assert stop_condition(request_after([7], min_tokens=2, stop_token_ids=[7]), None) is None
    assert stop_condition(request_after([5], min_tokens=2), "end") == (RequestStatus.FINISHED_STOPPED, "end")


def test_max_tokens_and_context_length_stop_with_length():
    assert stop_condition(request_after([5, 6], max_tokens=2), None) == (RequestStatus.FINISHED_LENGTH, None)
    assert stop_condition(request_after([5, 6], max_model_len=5), None) == (RequestStatus.FINISHED_LENGTH, None)


def test_length_wins_over_a_stop_string_in_the_same_token():
    assert stop_condition(request_after([5], max_tokens=1), "end") == (RequestStatus.FINISHED_LENGTH, None)


def test_a_stop_token_wins_over_a_stop_string_in_the_same_token():
    got = stop_condition(request_after([7], stop_token_ids=[7]), "end")
    assert got == (RequestStatus.FINISHED_STOPPED, 7)

"""Invalid sampling values raise RequestError naming the field."""
from __future__ import annotations

import pytest

from strata import RequestError, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("stop_token_ids", [-1]),
])
def test_invalid_value_raises_request_error_naming_the_field(field, value):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in info.value.message


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=0)
    assert p.stop == ["###"] and p.top_k == -1 and not p.greedy
    assert SamplingParams(temperature=0).greedy

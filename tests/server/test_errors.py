"""Error answers, curl-style over raw HTTP: status, OpenAI's error body, and the server still serving after."""
from __future__ import annotations

import httpx
import pytest
from conftest import ALIAS, API_KEY, MAX_MODEL_LEN, MODEL

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.fixture
def still_serving(http):
    """Checked after every error case: a normal request right after it is answered."""
    yield
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("length", "stop")


pytestmark = pytest.mark.usefixtures("still_serving")


def test_invalid_json_is_400(http):
    error = _error(http.post("/v1/completions", content=b'{"prompt": "x",', headers={
        "Content-Type": "application/json"}), 400)
    assert "JSON" in error["message"]


def test_a_form_body_is_refused_not_crashed(http):
    response = http.post("/v1/completions", data={"prompt": "x"})
    _error(response, 400)


def test_missing_field_is_named(http):
    error = _error(http.post("/v1/completions", json={"model": MODEL}), 400)
    assert error["param"] == "prompt" and "prompt" in error["message"]


def test_wrong_field_type_is_named(http):
    error = _error(http.post("/v1/completions", json={**GOOD, "max_tokens": "many"}), 400)
    assert error["param"] == "max_tokens"


def test_unknown_model_is_404(http):
    error = _error(http.post("/v1/completions", json={**GOOD, "model": "gpt-17"}), 404)
    assert error == {"message": f"The model `gpt-17` does not exist. This server serves `{MODEL}`, `{ALIAS}` "
                                "(GET /v1/models).", "type": "NotFoundError", "param": "model", "code": 404}
    _error(http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": [{"role": "user",
                                                                                    "content": "hi"}]}), 404)


def test_missing_model_means_the_first_served_name(http):
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["model"] == MODEL


def test_too_long_prompt_is_400_with_both_lengths(http):
    error = _error(http.post("/v1/completions", json={**GOOD, "prompt": [5] * (MAX_MODEL_LEN + 44)}), 400)
    assert str(MAX_MODEL_LEN + 44) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    _error(http.post("/v1/completions", json={**GOOD, "prompt": [5] * MAX_MODEL_LEN}), 400)
    streamed = http.post("/v1/completions", json={**GOOD, "prompt": [5] * 400, "stream": True})
    _error(streamed, 400)


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("max_tokens", 0), ("max_tokens", -1), ("top_k", -5),
                                         ("min_p", 2.0), ("temperature", -1.0), ("n", 0), ("top_p", 0.0)])
def test_invalid_sampling_values_are_400_naming_the_field(http, field, value):
    error = _error(http.post("/v1/completions", json={**GOOD, field: value}), 400)
    assert error["param"] == field


def test_min_tokens_above_max_tokens_stops_at_max_tokens(http):
    # /openapi.json cannot compare two fields, so this request is valid there; max_tokens is the hard limit.
    response = http.post("/v1/completions", json={**GOOD, "max_tokens": 2, "min_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 2 and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("prompt", [[-1, 5], [[3, -2]], [10**6], [], [[]]])
def test_bad_token_ids_and_empty_prompts_are_400(http, prompt):
    _error(http.post("/v1/completions", json={**GOOD, "prompt": prompt}), 400)


def test_prompt_logprobs_with_stream_is_400(http):
    _error(http.post("/v1/completions", json={**GOOD, "stream": True, "prompt_logprobs": 1}), 400)


def test_unsupported_options_are_refused_clearly(http):
    assert "best_of" in _error(http.post("/v1/completions", json={**GOOD, "best_of": 4}), 400)["message"]
    _error(http.post("/v1/completions", json={**GOOD, "use_beam_search": True}), 400)
    assert _error(http.post("/v1/completions", json={**GOOD, "response_format": {"type": "xml"}}), 400)["param"] == (
        "response_format")


def test_bad_chat_messages_are_400(http):
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "no role"}]}), 400)
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}], "top_logprobs": 3}), 400)


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions")])
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {API_KEY}", "Bearer"])
def test_every_v1_route_needs_the_api_key(server, method, path, header):
    headers = {} if header is None else {"Authorization": header}
    response = httpx.request(method, server.url + path, headers=headers, json=GOOD, timeout=30)
    error = _error(response, 401)
    assert error["type"] == "AuthenticationError"


def test_health_version_and_tokenizer_routes_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).status_code == 200


def test_unknown_route_is_404_in_the_error_shape(http):
    _error(http.get("/v1/nothing-here"), 404)

"""The app in-process (real engine, ASGI transport): engine failures, keyless access, entry points, units."""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from conftest import REPO, child_env

from strata.config import EngineConfig
from strata.engine.async_engine import AsyncEngine
from strata.errors import RequestError
from strata.multimodal.chat import parse_message_content
from strata.server.app import build_app
from strata.server.lifecycle import _resolve_model, _watch
from strata.server.metrics import ServerMetrics
from strata.server.protocol import ChatMessage


@pytest.fixture
def engine(server_checkpoint):
    config = EngineConfig.create(str(server_checkpoint), max_model_len=128, kv_cache_memory=1 << 20,
                                 served_model_name="inproc")
    eng = AsyncEngine.from_config(config)
    yield eng
    eng.shutdown()


def _break(engine: AsyncEngine) -> None:
    def boom():
        raise RuntimeError("boom: a worker fell over")

    engine.core.step = boom


async def _post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.post(path, json=body, headers=headers or {})


async def _get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.get(path)


def test_engine_failure_is_500_then_health_and_new_requests_are_503(engine):
    app = build_app(engine)
    _break(engine)
    response = asyncio.run(_post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 3}))
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "InternalServerError" and "boom" in error["message"] and error["code"] == 500
    assert asyncio.run(_get(app, "/health")).status_code == 503
    again = asyncio.run(_post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 3}))
    assert again.status_code == 503 and again.json()["error"]["type"] == "ServiceUnavailableError"


def test_engine_failure_while_streaming_sends_an_error_chunk_then_done(engine):
    app = build_app(engine)
    _break(engine)
    response = asyncio.run(_post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}))
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "Internal server error" in error["message"] and "boom" in error["message"]


def test_without_api_key_an_empty_bearer_is_accepted(engine):
    app = build_app(engine, argparse.Namespace(api_key=None, disable_log_requests=True))
    response = asyncio.run(_post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2},
                                 headers={"Authorization": "Bearer"}))
    assert response.status_code == 200 and response.json()["model"] == "inproc"


def test_each_app_has_its_own_metrics_registry(engine):
    first, second = ServerMetrics(engine, "a"), ServerMetrics(engine, "b")
    first.generation_tokens.labels("a").inc(3)
    assert b'strata:generation_tokens_total{model_name="a"} 3.0' in first.render()
    assert b"generation_tokens_total{" not in second.render()


def test_the_watchdog_stops_the_server_when_the_engine_dies():
    class Stub:
        started, should_exit, is_dead, dead_error = True, False, True, RuntimeError("gone")
        config = argparse.Namespace(served_model_names=("m",), model=argparse.Namespace(path="p"))

    stub = Stub()
    asyncio.run(asyncio.wait_for(_watch(stub, stub, argparse.Namespace(host="127.0.0.1", port=1)), 5))
    assert stub.should_exit


def test_no_model_serves_the_demo_under_its_name(monkeypatch, tmp_path):
    import strata.demo

    monkeypatch.setattr(strata.demo, "demo_checkpoint_path", lambda: tmp_path)
    args = argparse.Namespace(model=None, model_flag=None, served_model_name=None)
    assert _resolve_model(args) == (str(tmp_path), ["strata-demo"])
    args = argparse.Namespace(model=None, model_flag="/ckpt", served_model_name=["x"])
    assert _resolve_model(args) == ("/ckpt", ["x"])


def test_python_m_strata_server_takes_vllm_style_model_flag():
    out = subprocess.run([sys.executable, "-m", "strata.server", "--help"], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--served-model-name" in out.stdout and "--api-key" in out.stdout


def test_text_parts_are_joined_and_images_refused_for_text_models():
    messages = [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]
    dumped = [m.model_dump(exclude_none=True) for m in messages]
    assert parse_message_content(dumped, parts_format=False, multimodal=False)[0] == [
        {"role": "user", "content": "a\nb"}]
    image = [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "data:,"}}])]
    with pytest.raises(RequestError, match="text-only") as caught:
        parse_message_content([m.model_dump(exclude_none=True) for m in image], parts_format=False,
                              multimodal=False)
    assert caught.value.param == "messages.0.content.0"


async def _post_raw(app, path: str, content: bytes) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.post(path, content=content, headers={"content-type": "application/json"})


def test_bad_input_gets_400_or_413_quickly(engine):
    app = build_app(engine, argparse.Namespace(api_key=None, disable_log_requests=True, max_request_bytes=1 << 16))
    ok = {"prompt": "hi", "max_tokens": 2}
    cases = {
        "nested": b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        "not utf-8": b'{"prompt": "\xff\xfe"}',
        "huge n": json.dumps({**ok, "n": 10**9}).encode(),
        "huge max_tokens": json.dumps({**ok, "max_tokens": 10**30}).encode(),
        "NaN temperature": b'{"prompt": "hi", "temperature": NaN}',
        "logit_bias ids": json.dumps({**ok, "logit_bias": {"99999999": 1.0, "x": 2}}).encode(),
        "many stops": json.dumps({**ok, "stop": [f"s{i}" for i in range(5000)]}).encode(),
    }
    began = time.monotonic()
    for name, content in cases.items():
        response = asyncio.run(_post_raw(app, "/v1/completions", content))
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["code"] == 400
    too_big = asyncio.run(_post_raw(app, "/v1/completions", json.dumps({"prompt": "x" * (1 << 17)}).encode()))
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "RequestTooLargeError"
    assert time.monotonic() - began < 10


def test_unknown_fields_are_ignored_and_known_ones_still_validated(engine):
    app = build_app(engine)
    vllm_router_extras = {"skip_special_tokens": True, "ignore_eos": False, "no_stop_trim": False,
                          "some_future_field": {"x": 1}}
    response = asyncio.run(_post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, **vllm_router_extras}))
    assert response.status_code == 200
    bad = asyncio.run(_post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": "many", "no_stop_trim": 1}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_openapi_describes_request_and_response_bodies_and_errors(engine):
    schema = asyncio.run(_get(build_app(engine), "/openapi.json")).json()
    post = schema["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert set(post["responses"]) == {"200", "400", "401", "404", "413", "503"}
    assert post["responses"]["503"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    components = schema["components"]["schemas"]
    assert {"messages", "max_completion_tokens", "top_k", "ignore_eos"} <= set(
        components["ChatCompletionRequest"]["properties"])
    assert set(components["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    assert schema["paths"]["/get_load"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/LoadResponse"}


async def _request(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.request(method, path, json=body)


def test_openapi_states_what_validation_enforces(engine, server_checkpoint):
    import jsonschema

    app = build_app(engine)
    doc = asyncio.run(_get(app, "/openapi.json")).json()
    vocab = json.loads((server_checkpoint / "config.json").read_text())["vocab_size"]
    max_n = engine.config.scheduler.max_num_seqs

    def documented(path: str, body: dict) -> bool:
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).is_valid(body)

    refused = [("/v1/chat/completions", {"messages": []}), ("/invocations", {"messages": []}), ("/tokenize", {}),
               ("/v1/completions", {"prompt": "hi", "top_k": -2}), ("/detokenize", {"tokens": [vocab]}),
               ("/v1/completions", {"prompt": "hi", "n": max_n + 1}), ("/v1/completions", {"prompt": "hi", "top_p": 0}),
               ("/v1/completions", {"prompt": [vocab]}), ("/v1/completions", {"prompt": "hi", "stream_options": {}})]
    accepted = [("/detokenize", {"tokens": [0, vocab - 1]}), ("/tokenize", {"prompt": "hi"}),
                ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/completions", {"prompt": [vocab - 1], "top_k": -1, "n": max_n, "max_tokens": 1})]
    for path, body in refused:
        assert not documented(path, body), (path, body)
        assert asyncio.run(_post(app, path, body)).status_code == 400, (path, body)
    for path, body in accepted:
        assert documented(path, body), (path, body)
        assert asyncio.run(_post(app, path, body)).status_code == 200, (path, body)


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("TRACE", "/v1/completions", {"POST"}), ("PUT", "/health", {"GET"}), ("DELETE", "/tokenize", {"POST"})])
def test_an_undeclared_method_is_405_naming_the_allowed_ones(engine, method, path, allowed):
    response = asyncio.run(_request(build_app(engine), method, path))
    assert response.status_code == 405 and response.json()["error"]["code"] == 405
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed  # RFC 9110, 15.5.6

"""Many concurrent streams, a third of the clients leaving early: the rest finish and every block comes back."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
from conftest import MODEL, read_metrics

NUM_REQUESTS = 100
MAX_TOKENS = 48
# Requests whose clients leave ask for far more, so that they cannot finish before the client is gone.
LEAVER_MAX_TOKENS = 240


async def _stream(client: httpx.AsyncClient, i: int, leave_early: bool) -> dict | None:
    body = {"model": MODEL, "prompt": [40 + i % 50, 60, 61, 62 + i % 7],
            "max_tokens": LEAVER_MAX_TOKENS if leave_early else MAX_TOKENS,
            "ignore_eos": True, "temperature": 1.0, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        finish, usage, done = None, None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if leave_early:
                return None  # leaving the `async with` closes the connection mid-stream
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                finish = chunk["choices"][0]["finish_reason"]
            usage = chunk["usage"] or usage
    assert done
    return {"finish": finish, "usage": usage}


async def _run_all(url: str, headers: dict) -> list[dict | None]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_stream(client, i, i % 3 == 0) for i in range(NUM_REQUESTS)))


def _wait_idle(url: str, timeout_s: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(url)
        if (m["strata:num_requests_running"] == 0 and m["strata:num_requests_waiting"] == 0) or \
                time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_disconnected_streams_are_aborted_and_the_rest_complete(server):
    before = _wait_idle(server.url)
    results = asyncio.run(_run_all(server.url, server.headers))
    finished = [r for r in results if r is not None]
    assert len(finished) == NUM_REQUESTS - len(range(0, NUM_REQUESTS, 3))
    for r in finished:
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == MAX_TOKENS
    after = _wait_idle(server.url)
    assert after["strata:num_requests_running"] == 0 and after["strata:num_requests_waiting"] == 0
    # Prefix caching keeps freed blocks reusable, but they count as free: the pool is whole again.
    assert after["strata:kv_cache_free_blocks"] == after["strata:kv_cache_total_blocks"]
    assert after["strata:kv_cache_usage_perc"] == 0.0

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    aborted = len(range(0, NUM_REQUESTS, 3))
    assert delta('strata:request_success_total{finished_reason="abort"}') == aborted
    assert delta('strata:request_success_total{finished_reason="length"}') == NUM_REQUESTS - aborted
    # The leavers were stopped on average within MAX_TOKENS of their LEAVER_MAX_TOKENS.
    assert delta("strata:generation_tokens_total") < (NUM_REQUESTS - aborted) * MAX_TOKENS + aborted * MAX_TOKENS
    assert delta("strata:time_to_first_token_seconds_count") == NUM_REQUESTS


async def _time_out_all(url: str, headers: dict, n: int, timeout_s: float) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "write a lot"}], "max_tokens": 200,
            "min_tokens": 200, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s) as client:
        results = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(n)),
                                       return_exceptions=True)
    return sum(isinstance(r, httpx.TimeoutException) for r in results)


def test_non_streamed_requests_are_aborted_when_their_clients_time_out(server, http):
    # The clients give up an eighth of the way through what the same requests take here whole, timed on a round
    # after a first one (which pays one-time costs): on a quiet fast machine the tiny model finishes them in well
    # under a fixed 0.4 s, and then there is nothing left to abort; a quarter of a first round's time once left the
    # requests too little time after the clients left for the server to see them go (none aborted, on CI).
    _wait_idle(server.url)
    assert asyncio.run(_time_out_all(server.url, server.headers, 20, 60.0)) == 0
    started = time.monotonic()
    assert asyncio.run(_time_out_all(server.url, server.headers, 20, 60.0)) == 0
    whole = time.monotonic() - started
    before = _wait_idle(server.url)
    assert asyncio.run(_time_out_all(server.url, server.headers, 20, min(0.4, whole / 8))) == 20
    after = _wait_idle(server.url)
    assert after["strata:num_requests_running"] == 0
    aborted = after.get('strata:request_success_total{finished_reason="abort"}', 0) - before.get(
        'strata:request_success_total{finished_reason="abort"}', 0)
    assert aborted == 20
    assert http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=5).status_code == 200

"""Overload and shutdown of a real `strata serve`: 503 + Retry-After past --max-waiting-requests, SIGTERM drains
(new requests 503, running ones finish or get an error, exit 0), a second SIGINT exits at once."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from conftest import MODEL, read_metrics, start_server, stop_server

pytestmark = pytest.mark.slow


def _start(checkpoint, tmp_path, *extra: str):
    return start_server(checkpoint, tmp_path / "server.log", "--served-model-name", MODEL, "--max-model-len",
                        "256", "--kv-cache-memory", "8M", *extra)


async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int, started: asyncio.Event | None = None
                  ) -> str:
    """'length' when the stream ended normally, 'error' when it ended with an error event; [DONE] always last."""
    body = {"model": MODEL, "prompt": [30 + i, 31, 32], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    outcome = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        if started is not None:  # the headers came: the request is accepted and in flight
            started.set()
        events = [line[6:] async for line in _lines(response)]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            assert chunk["error"]["code"] == 503
            outcome = "error"
        elif chunk["choices"][0]["finish_reason"]:
            outcome = chunk["choices"][0]["finish_reason"]
    return outcome


async def _lines(response: httpx.Response):
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line


async def _drain_while_streaming(server, n: int, max_tokens: int) -> tuple[list[str], list[int]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        started = [asyncio.Event() for _ in range(n)]
        streams = [asyncio.create_task(_stream(c, i, max_tokens, started[i])) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        server.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:  # a new connection
            refused = [(await fresh.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code,
                       (await fresh.get("/health")).status_code]
        return await asyncio.gather(*streams), refused


def test_sigterm_lets_running_streams_finish_refuses_new_requests_and_exits_0(server_checkpoint, tmp_path):
    server = _start(server_checkpoint, tmp_path, "--max-num-seqs", "8", "--shutdown-timeout", "60")
    try:
        outcomes, refused = asyncio.run(_drain_while_streaming(server, 20, 200))
        assert outcomes == ["length"] * 20
        assert refused == [503, 503]
        assert server.process.wait(timeout=30) == 0
    finally:
        stop_server(server)


def test_drain_timeout_ends_what_is_left_with_an_error_and_exits_0(server_checkpoint, tmp_path):
    # One sequence at a time: 16 streams of 240 tokens (3840 in all) outlast half a second; of 8, 5 once finished
    # within it on 2 Xeon cores (3 of 16 here when run alone).
    server = _start(server_checkpoint, tmp_path, "--max-num-seqs", "1", "--shutdown-timeout", "0.5")
    try:
        outcomes, refused = asyncio.run(_drain_while_streaming(server, 16, 240))
        assert set(outcomes) <= {"length", "error"} and outcomes.count("error") >= 4, outcomes
        assert refused == [503, 503]
        assert server.process.wait(timeout=30) == 0
    finally:
        stop_server(server)


async def _burst(url: str, n: int) -> list[httpx.Response]:
    body = {"model": MODEL, "prompt": [40, 41, 42], "max_tokens": 16, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))


def test_past_max_waiting_requests_new_ones_get_503_with_retry_after(server_checkpoint, tmp_path):
    server = _start(server_checkpoint, tmp_path, "--max-num-seqs", "2", "--max-waiting-requests", "4")
    try:
        responses = asyncio.run(asyncio.wait_for(_burst(server.url, 30), 120))
        codes = [r.status_code for r in responses]
        assert set(codes) == {200, 503} and codes.count(200) >= 4
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        deadline = time.monotonic() + 10
        while (m := read_metrics(server.url))["strata:num_requests_running"] + m["strata:num_requests_waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert m["strata:kv_cache_usage_perc"] == 0.0
        assert httpx.get(f"{server.url}/get_load").json() == {"load": 0}
    finally:
        stop_server(server)


def test_a_second_sigint_exits_at_once(server_checkpoint, tmp_path):
    # A stream long enough that it cannot end between the two signals, however fast decode is.
    server = _start(server_checkpoint, tmp_path, "--max-num-seqs", "2", "--shutdown-timeout", "60",
                    "--max-model-len", "4096", "--kv-cache-memory", "64M")
    try:
        async def run() -> str:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream(client, 0, 4000, started))
                await asyncio.wait_for(started.wait(), 60)
                server.process.send_signal(signal.SIGINT)
                await asyncio.sleep(0.3)
                server.process.send_signal(signal.SIGINT)
                return await stream

        began = time.monotonic()
        assert asyncio.run(run()) == "error"
        assert server.process.wait(timeout=10) == 0 and time.monotonic() - began < 10
    finally:
        stop_server(server)

"""Two strata replicas behind a real vllm-router process (PyPI `vllm-router`): round robin spreads, cache_aware
keeps a shared prefix on one replica, streams pass through unchanged, a killed replica is routed around and
used again once it is back."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import MODEL, child_env, free_port, read_metrics, start_server, stop_server

pytestmark = pytest.mark.slow
# The console script sits beside the interpreter of a virtual environment that need not be on PATH.
ROUTER = shutil.which("vllm-router") or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
SUCCESS = 'strata:request_success_total{finished_reason="length"}'
# A long shared prefix (in words) that is most of each prompt (~280 tokens).
PREFIX = "You are a careful assistant who answers about the history of science and its people. " * 4


def _start_replica(checkpoint, tmp_path, name: str, port: int | None = None):
    return start_server(checkpoint, tmp_path / f"{name}.log", "--served-model-name", MODEL, "--max-model-len",
                        "512", "--kv-cache-memory", "8M", "--max-num-seqs", "8", port=port)


@pytest.fixture(scope="module")
def replicas(server_checkpoint, tmp_path_factory):
    if ROUTER is None:
        pytest.fail("vllm-router is not installed: pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("replicas")
    started = [_start_replica(server_checkpoint, tmp, f"replica{i}") for i in range(2)]
    yield started
    for replica in started:
        stop_server(replica)


class Router:
    def __init__(self, urls: list[str], policy: str, log) -> None:
        self.port = free_port()
        cmd = [ROUTER, "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1", "--port",
               str(self.port), "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--worker-startup-timeout-secs", "60", "--log-level", "warning"]
        self.log = open(log, "w")
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=child_env(),
                                        start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, open(log).read()[-2000:]
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"vllm-router did not start:\n{open(log).read()[-2000:]}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _served(replicas) -> list[float]:
    return [read_metrics(r.url).get(SUCCESS, 0.0) for r in replicas]


def _complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_round_robin_spreads_requests_evenly_and_passes_models_and_chat(replicas, tmp_path):
    router = Router([r.url for r in replicas], "round_robin", tmp_path / "router.log")
    try:
        before = _served(replicas)
        for i in range(8):
            _complete(router.url, f"question number {i}")
        after = _served(replicas)
        assert [a - b for a, b in zip(after, before, strict=True)] == [4, 4]
        assert httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
        chat = httpx.post(f"{router.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    finally:
        router.stop()


def _stream_text(url: str, endpoint: str, body: dict) -> tuple[str, bool]:
    text, done = "", False
    with httpx.stream("POST", f"{url}{endpoint}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, done


def test_streams_through_the_router_equal_streams_direct(replicas, tmp_path):
    router = Router([r.url for r in replicas], "round_robin", tmp_path / "router.log")
    try:
        for endpoint, body in (("/v1/completions", {"prompt": "Once upon a time"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me"}]})):
            body = {**body, "model": MODEL, "max_tokens": 12, "temperature": 0}
            direct = _stream_text(replicas[0].url, endpoint, body)
            routed = [_stream_text(router.url, endpoint, body) for _ in range(2)]  # one through each replica
            assert direct[1] and routed == [direct, direct]
    finally:
        router.stop()


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(replicas, tmp_path):
    router = Router([r.url for r in replicas], "cache_aware", tmp_path / "router.log")
    try:
        before = [read_metrics(r.url) for r in replicas]
        for i in range(6):
            _complete(router.url, f"{PREFIX} Question {i}: who?")
        after = [read_metrics(r.url) for r in replicas]
        served = [a.get(SUCCESS, 0) - b.get(SUCCESS, 0) for a, b in zip(after, before, strict=True)]
        assert sorted(served) == [0, 6]
        chosen = served.index(6)
        hits = after[chosen]["strata:prefix_cache_hits_total"] - before[chosen]["strata:prefix_cache_hits_total"]
        assert hits >= 5 * 256  # every request after the first reuses the prefix's full blocks
    finally:
        router.stop()


def test_a_killed_replica_is_routed_around_and_used_again_once_restarted(replicas, server_checkpoint, tmp_path):
    router = Router([r.url for r in replicas], "round_robin", tmp_path / "router.log")
    try:
        victim = replicas[1]
        port = int(victim.url.rsplit(":", 1)[1])
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(timeout=10)
        time.sleep(2.5)  # a failed health check or two
        for i in range(4):
            _complete(router.url, f"while one is down {i}")
        replicas[1] = _start_replica(server_checkpoint, tmp_path, "restarted", port=port)
        deadline = time.monotonic() + 30
        while read_metrics(replicas[1].url).get(SUCCESS, 0.0) == 0:
            assert time.monotonic() < deadline, "the router never used the restarted replica"
            _complete(router.url, "are you back?")
            time.sleep(0.3)
    finally:
        router.stop()

"""`strata serve -tp 2 -pp 2`: the tokens of one process, streamed and not; a killed worker stops the server."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from conftest import start_server, stop_server
from processes import descendants, spawned_workers, wait_gone

from strata import LLM, SamplingParams

MAX_LEN = 256
ENGINE_FLAGS = ["--max-model-len", str(MAX_LEN), "--kv-cache-memory", "4M", "--max-num-seqs", "16", "--seed", "0"]
PROMPTS = [[45, 46, 47, 48, 49], [60, 61, 62], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]]
pytestmark = pytest.mark.slow


def params_for(i: int, seeded: bool) -> dict:
    if seeded:
        return {"temperature": 1.0, "top_p": 0.9, "seed": 10 + i, "max_tokens": 12, "ignore_eos": True}
    return {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected(server_checkpoint) -> dict[bool, list[str]]:
    with LLM(str(server_checkpoint), max_model_len=MAX_LEN, kv_cache_memory=4 << 20, max_num_seqs=16) as llm:
        return {seeded: [o.outputs[0].text for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [SamplingParams(**params_for(i, seeded)) for i in range(len(PROMPTS))], use_tqdm=False)]
            for seeded in (False, True)}


@pytest.fixture(scope="module")
def parallel_server(server_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("parallel_server") / "server.log"
    server = start_server(server_checkpoint, log, "-tp", "2", "-pp", "2", "--served-model-name", "par", *ENGINE_FLAGS)
    yield server
    assert stop_server(server) == 0, log.read_text()[-3000:]


def complete(url: str, prompt: list[int], body: dict) -> str:
    response = httpx.post(f"{url}/v1/completions", json={"model": "par", "prompt": prompt, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def complete_streamed(url: str, prompt: list[int], body: dict) -> str:
    text = ""
    request = {"model": "par", "prompt": prompt, "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
    return text


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tp2_pp2_server_gives_the_text_of_one_process(parallel_server, expected, seeded, stream):
    send = complete_streamed if stream else complete
    got = [send(parallel_server.url, p, params_for(i, seeded)) for i, p in enumerate(PROMPTS)]
    assert got == expected[seeded]


def test_a_batched_request_gives_the_text_of_one_process(parallel_server, expected):
    body = {"model": "par", "prompt": PROMPTS, **params_for(0, seeded=False)}
    response = httpx.post(f"{parallel_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == expected[False]


def kill_during_a_stream(server, worker: int) -> list[str]:
    """Kill `worker` once a long stream has started; returns the stream's error events."""
    body = {"model": "par", "prompt": PROMPTS[0], "max_tokens": MAX_LEN - 10, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(worker, signal.SIGKILL)
        return [line for line in lines if '"error"' in line]


@pytest.mark.parametrize("when", ["mid_stream", "idle"])
def test_a_killed_worker_turns_health_503_and_ends_the_server_with_no_process_left(server_checkpoint, tmp_path,
                                                                                  when):
    server = start_server(server_checkpoint, tmp_path / "server.log", "-pp", "2", "--served-model-name", "par",
                          *ENGINE_FLAGS)
    try:
        workers = spawned_workers(server.process.pid)
        assert len(workers) == 2
        everything = descendants(server.process.pid)
        killed_at = time.monotonic()
        if when == "mid_stream":
            errors = kill_during_a_stream(server, workers[-1])
            assert errors and "exited with code -9" in errors[0], "the in-flight request did not fail"
        else:
            os.kill(workers[0], signal.SIGKILL)
        statuses = []
        while server.process.poll() is None and time.monotonic() - killed_at < 30:
            try:
                statuses.append(httpx.get(f"{server.url}/health", timeout=2).status_code)
            except httpx.HTTPError:
                statuses.append(None)  # no longer listening
            time.sleep(0.01)
        # Between the engine's death and the server's exit, /health answers 503.
        assert 503 in statuses
        assert server.process.wait(timeout=30) != 0
        assert time.monotonic() - killed_at < 15
        assert wait_gone(everything, 10) == []
    finally:
        if server.process.poll() is None:
            stop_server(server)

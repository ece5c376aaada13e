"""`strata serve` as a new user starts it: a GGUF file served under the name it was given, the printed client
command works as printed, the API key from the environment, an unknown model's 404 naming the served ones."""
from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, start_server, stop_server

from strata.server.lifecycle import client_example, resolve_api_key


def test_api_key_flag_wins_then_strata_then_vllm_variable(monkeypatch):
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert resolve_api_key(None) == "from-vllm"
    monkeypatch.setenv("STRATA_API_KEY", "")  # set but empty: not a key
    assert resolve_api_key(None) == "from-vllm"
    monkeypatch.setenv("STRATA_API_KEY", "from-strata")
    assert resolve_api_key(None) == "from-strata"
    assert resolve_api_key("from-flag") == "from-flag"


def _request_of(command: str) -> tuple[str, dict[str, str], dict]:
    """URL, headers and JSON body of a printed `curl URL -H ... -d BODY` command, read as a shell would
    (variables expanded from this process's environment)."""
    words = shlex.split(command)
    assert words[0] == "curl"
    headers = dict(os.path.expandvars(words[i + 1]).split(": ", 1) for i, w in enumerate(words) if w == "-H")
    body = json.loads(words[words.index("-d") + 1])
    return words[1], headers, body


def test_client_example_quotes_any_served_name_and_never_prints_the_key(monkeypatch):
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sekret")
    name = "/tmp/it's a \"model\".gguf"
    command = client_example([name, "other"], "0.0.0.0", 8123, "sekret")
    assert "sekret" not in command
    url, headers, body = _request_of(command)
    assert url == "http://127.0.0.1:8123/v1/completions" and body["model"] == name
    assert headers == {"Content-Type": "application/json", "Authorization": "Bearer sekret"}
    assert "Authorization" not in client_example([name], "::1", 1, None)
    assert _request_of(client_example([name], "::1", 1, None))[0] == "http://[::1]:1/v1/completions"


def _logged_command(log: Path) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [line.split("try: ", 1)[1] for line in log.read_text().splitlines() if " try: curl " in line]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no client example in the log:\n{log.read_text()[-3000:]}")


def test_a_gguf_file_is_served_under_the_name_given_and_the_printed_client_works(gguf_tied_q4_1, tmp_path,
                                                                                    monkeypatch):
    given = os.path.relpath(gguf_tied_q4_1, REPO)  # a relative path, as typed in the repository
    monkeypatch.setenv("STRATA_API_KEY", "env-key")
    monkeypatch.setenv("VLLM_API_KEY", "other-key")
    log = tmp_path / "server.log"
    server = start_server(Path(given), log, "--max-model-len", "64", "--kv-cache-memory", "4M", "--max-num-seqs", "4",
                          "--log-level", "Info", "--enforce-eager", "--swap-space", "4")
    try:
        url, headers, body = _request_of(_logged_command(log))
        assert body["model"] == given and url == f"{server.url}/v1/completions"
        answer = httpx.post(url, headers=headers, json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == given
        assert answer.json()["usage"]["completion_tokens"] > 0

        key = {"Authorization": "Bearer env-key"}
        models = httpx.get(f"{server.url}/v1/models", headers=key, timeout=10).json()["data"]
        assert [(m["id"], m["root"]) for m in models] == [(given, given)]
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer other-key"},
                         timeout=10).status_code == 401

        missing = httpx.post(url, headers=key, json={**body, "model": "gpt-17"}, timeout=10)
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == (f"The model `gpt-17` does not exist. This server serves "
                                                      f"`{given}` (GET /v1/models).")
    finally:
        assert stop_server(server) == 0
    text = log.read_text()
    assert text.count("ignoring --enforce-eager") == 1 and text.count("ignoring --swap-space") == 1
    assert "API key from STRATA_API_KEY" in text and "env-key" not in text


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_client_example_keeps_a_reachable_host(host):
    assert _request_of(client_example(["m"], host, 80, None))[0] == f"http://{host}:80/v1/completions"

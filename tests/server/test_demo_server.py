"""`strata serve` with no model serves the built-in strata-demo checkpoint (the README's first command)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest
from conftest import REPO, Server, child_env, free_port, stop_server

from strata.demo import demo_checkpoint_path

pytestmark = pytest.mark.slow


def test_serve_without_a_model_serves_strata_demo(tmp_path):
    port = free_port()
    log = tmp_path / "demo.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port)], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPO, env=child_env(), start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", demo_checkpoint_path(), log, process)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["strata-demo"]
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": "def read(self):\n", "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "strata-demo"
        assert r.json()["usage"]["completion_tokens"] >= 1
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                   "lines": {"type": "integer", "minimum": 1, "maximum": 99},
                                                   "kind": {"enum": ["function", "class"]}},
                  "required": ["name", "lines", "kind"]}
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Describe a Python function as JSON."}], "max_tokens": 120,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    finally:
        assert stop_server(server) == 0, log.read_text()[-3000:]

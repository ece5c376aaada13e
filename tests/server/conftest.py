"""One real `strata serve` subprocess per session on a tiny checkpoint, and clients for it."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from checkpoints import make_llama

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "tiny"
ALIAS = "tiny-alias"
MAX_MODEL_LEN = 256
_START_TIMEOUT_S = 90


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    checkpoint: Path
    log: Path
    process: subprocess.Popen

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", NO_PROXY="127.0.0.1,localhost")
    return env


# Loaded here, not in the forked child, where an import could wait on a lock held by another thread.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """Runs in the child before exec: if pytest itself is killed, the server gets SIGTERM (Linux only)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def start_server(checkpoint: Path, log: Path, *extra: str, port: int | None = None) -> Server:
    port = port or free_port()
    cmd = [sys.executable, "-m", "strata", "serve", str(checkpoint), "--port", str(port), *extra]
    with open(log, "w") as out:
        # A session of its own, so the whole process group can be ended without touching pytest.
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=child_env(),
                                   start_new_session=True, preexec_fn=_die_with_parent)
    server = Server(f"http://127.0.0.1:{port}", checkpoint, log, process)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"strata serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"strata serve did not become healthy in {_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop_server(server: Server) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=10)
    return server.process.returncode


@pytest.fixture(scope="session")
def server_checkpoint(tmp_path_factory) -> Path:
    # 512 tokens, so the BPE has merges and every tokenizer id is inside the model's vocabulary.
    return make_llama(tmp_path_factory.mktemp("server_llama"), vocab_size=512, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, intermediate_size=128, seed=7)


@pytest.fixture(scope="session")
def server(server_checkpoint, tmp_path_factory) -> Server:
    log = tmp_path_factory.mktemp("server_log") / "server.log"
    srv = start_server(server_checkpoint, log, "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name",
                       MODEL, ALIAS, "--api-key", API_KEY, "--kv-cache-memory", "8M", "--max-num-seqs", "128",
                       "--seed", "0")
    yield srv
    code = stop_server(srv)
    assert code == 0, f"strata serve exited with {code}:\n{log.read_text()[-3000:]}"


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(server_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_checkpoint)


def read_metrics(url: str) -> dict[str, float]:
    """Every sample on /metrics as {'name' or 'name{label="v"}': value}; the model_name label is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples

"""The multiprocess executor's life cycle: multi-node runs, dead or failing workers, shutdown, signals."""
from __future__ import annotations

import gc
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from processes import alive, free_port, wait_gone, wait_reaped

from strata import LLM, ConfigError, EngineDeadError, SamplingParams
from strata.executor.step import ScheduledRequest, SchedulerOutput

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "import os", "Once upon a time"]
pytestmark = pytest.mark.slow


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def stop(proc: subprocess.Popen) -> None:
    """End a test's subprocess and everything it started (it runs in a session of its own)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output from the child within {timeout_s} s"
    return proc.stdout.readline().decode()


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected_tokens(llama5, engine_args) -> list[list[int]]:
    with LLM(str(llama5), **engine_args) as llm:
        return greedy_tokens(llm)


def start_node1(checkpoint: Path, log: Path, port: int, *extra: str) -> subprocess.Popen:
    """`strata serve` as node 1 of 2 (ranks 2 and 3 of tp=2 x pp=2), in a session of its own."""
    cmd = [sys.executable, "-m", "strata", "serve", str(checkpoint), "-tp", "2", "-pp", "2", "--nnodes", "2",
           "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=child_env(), start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)


def test_two_nodes_on_localhost_give_the_tokens_of_one_process(llama5, engine_args, cli_engine_args,
                                                               expected_tokens, tmp_path):
    port = free_port()
    node1 = start_node1(llama5, tmp_path / "node1.log", port, *cli_engine_args)
    try:
        llm = LLM(str(llama5), tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                  master_addr="127.0.0.1", master_port=port, **engine_args)
        executor = llm.engine.executor
        assert len(executor.worker_pids) == 2  # ranks 2 and 3 run under node 1
        remote = [i.pid for i in executor.rank_infos if i.pid not in executor.worker_pids]
        assert [i.rank for i in executor.rank_infos if i.pid in remote] == [2, 3]
        assert greedy_tokens(llm) == expected_tokens
        llm.shutdown()
        assert node1.wait(timeout=20) == 0, (tmp_path / "node1.log").read_text()[-3000:]
        assert wait_gone(remote, 5) == []
    finally:
        stop(node1)


def test_nodes_started_with_different_flags_are_refused(llama5, engine_args, cli_engine_args, tmp_path):
    port = free_port()
    node1 = start_node1(llama5, tmp_path / "node1.log", port, *cli_engine_args, "--dtype", "bfloat16")
    try:
        with pytest.raises(ConfigError, match="dtype='bfloat16' \\(node 0: 'float32'\\)"):
            LLM(str(llama5), tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                master_addr="127.0.0.1", master_port=port, dtype="float32", **engine_args)
        assert node1.wait(timeout=20) != 0
    finally:
        stop(node1)
    assert multiprocessing.active_children() == []


def test_a_killed_worker_fails_the_caller_within_seconds_and_leaves_no_process(llama5, engine_args):
    llm = LLM(str(llama5), pipeline_parallel_size=2, **engine_args)
    pids = llm.engine.executor.worker_pids
    killed_at: list[float] = []

    def kill_once_generating() -> None:
        deadline = time.monotonic() + 60
        while llm.engine.stats["generation_tokens"] < 8 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(pids[-1], signal.SIGKILL)
        killed_at.append(time.monotonic())

    threading.Thread(target=kill_once_generating, daemon=True).start()
    params = SamplingParams(temperature=0, max_tokens=engine_args["max_model_len"] - 30, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 5
    assert wait_gone(pids, 5) == []
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    llm.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("how", ["shutdown", "killed_worker"])
def test_no_zombie_is_left_after_shutdown_or_a_dead_worker(llama5, engine_args, how):
    llm = LLM(str(llama5), tensor_parallel_size=2, **engine_args)
    executor = llm.engine.executor
    pids = executor.worker_pids
    if how == "killed_worker":
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                executor.check_health()
            except EngineDeadError:
                break
            time.sleep(0.05)
        with pytest.raises(EngineDeadError):
            executor.check_health()
        # The engine reaps its workers as it stops, before anyone calls shutdown.
        assert wait_reaped(pids, 5) == []
    llm.shutdown()
    assert wait_reaped(pids, 5) == []
    assert multiprocessing.active_children() == []


def test_a_worker_that_raises_stops_the_engine_and_every_worker(llama5, engine_args):
    llm = LLM(str(llama5), tensor_parallel_size=2, **engine_args)
    executor = llm.engine.executor
    pids = executor.worker_pids
    # A step about a request the workers never saw: the sampler's lookup raises on both ranks.
    handle = executor.submit(SchedulerOutput([ScheduledRequest("never-added", [5], 0, [1], True)]))
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="KeyError"):
        executor.collect(handle)
    assert time.monotonic() - started < 5
    assert wait_gone(pids, 5) == []
    llm.shutdown()


def test_a_garbage_collected_llm_stops_its_workers(llama5, engine_args):
    llm = LLM(str(llama5), tensor_parallel_size=2, **engine_args)
    pids = llm.engine.executor.worker_pids
    assert all(alive(p) for p in pids)
    del llm
    gc.collect()
    assert wait_gone(pids, 10) == []


# The driver takes Ctrl-C's default action, as a program started from a terminal does: a test run started in the
# background of a non-interactive shell (`pytest ... &`) has SIGINT ignored, and its children inherit that.
DRIVER_SCRIPT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from strata import LLM
llm = LLM(sys.argv[1], pipeline_parallel_size=2, max_model_len=128, kv_cache_memory=4 << 20)
executor = llm.engine.executor
print(executor._driver.port, " ".join(map(str, executor.worker_pids)), flush=True)
time.sleep(300)
"""
# How many times each signal is tried under load; STRATA_SIGNAL_ROUNDS=30 is the long version, run by hand.
SIGNAL_ROUNDS = int(os.environ.get("STRATA_SIGNAL_ROUNDS", "1"))


@contextmanager
def busy_cores():
    """A CPU burner on every core, as when the rest of a test suite runs beside the test."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("strata-*")} if Path("/dev/shm").is_dir() else set()


def port_is_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("how", ["sigterm_to_the_driver", "ctrl_c_to_the_process_group"])
def test_a_signalled_driver_takes_its_workers_down_on_a_busy_machine(llama5, how):
    with busy_cores():
        for _ in range(SIGNAL_ROUNDS):
            segments = shm_segments()
            proc = subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, str(llama5)], cwd=REPO, env=child_env(),
                                    stdout=subprocess.PIPE, start_new_session=True)
            try:
                port, *pids = [int(p) for p in read_line(proc, 240).split()]
                assert len(pids) == 2 and all(alive(p) for p in pids)
                if how == "sigterm_to_the_driver":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
                proc.wait(timeout=15)
                assert wait_gone(pids, 5) == []
                assert port_is_closed(port)
                assert shm_segments() <= segments
            finally:
                stop(proc)


def test_shutdown_twice_leaves_no_process_segment_or_port(llama5, engine_args):
    segments = shm_segments()
    llm = LLM(str(llama5), tensor_parallel_size=2, **engine_args)  # two ranks of one machine share a segment
    executor = llm.engine.executor
    pids, port = executor.worker_pids, executor._driver.port
    assert greedy_tokens(llm)
    started = time.monotonic()
    llm.shutdown()
    llm.shutdown()
    assert time.monotonic() - started < 10
    assert wait_reaped(pids, 5) == []
    assert port_is_closed(port)
    assert shm_segments() <= segments
    assert not executor._driver.watchdog.is_alive()

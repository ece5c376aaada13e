"""MultiprocExecutor: spawns this node's TP x PP worker processes and drives them; headless nodes for multi-node.

Node 0's driver hosts the TCPStore every rank meets at (torch.distributed rendezvous and control
messages, see strata.executor.protocol). A step goes to every rank at once; stage i receives stage i-1's
hidden states, runs its layers and hands on; the last stage's TP rank 0 writes the result back.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from strata.config import EngineConfig, resolve_device
from strata.errors import ConfigError, EngineDeadError
from strata.executor import protocol
from strata.executor.model_runner import RunnerOutput
from strata.executor.protocol import RankInfo, WorkerSpec, connect_store, shared_settings
from strata.executor.spawn_guard import guard_message, refuse_engine_in_spawn_bootstrap, unguarded_main_script
from strata.executor.step import PoolingStep, SchedulerOutput
from strata.executor.worker import worker_main
from strata.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint, or waiting for the other nodes to start
_RESULT_TIMEOUT = timedelta(minutes=30)  # one step; liveness is watched separately, this is a last resort
# Shutdown's whole wait for the ranks to leave on their own (store connection, goodbye, exit); then SIGTERM,
# _TERM_WAIT_S later SIGKILL. One deadline, so that the waits do not add up.
_GOODBYE_WAIT_S = 5.0
_TERM_WAIT_S = 2.0
_KILL_WAIT_S = 30.0
_WATCHDOG_JOIN_S = 2.0


def _local_ranks(config: EngineConfig, node_rank: int) -> range:
    per_node = config.parallel.world_size // config.parallel.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def spawn_workers(config: EngineConfig, ranks: Iterable[int], host: str, port: int) -> list:
    """Start one spawned process per rank (never fork: the parent may hold threads, CUDA or a server)."""
    refuse_engine_in_spawn_bootstrap()
    ranks = list(ranks)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for local_rank, rank in enumerate(ranks):
        spec = WorkerSpec(config, rank, local_rank, len(ranks), host, port, os.getpid(),
                          max(1, cores // len(ranks)), backend, logging.getLogger().getEffectiveLevel(),
                          _STARTUP_TIMEOUT_S)
        proc = ctx.Process(target=worker_main, args=(spec,), name=f"strata-worker{spec.log_prefix}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def stop_processes(procs: list, grace_s: float) -> None:
    """Wait up to `grace_s` for processes to leave on their own, then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs:
        proc.join(_TERM_WAIT_S)
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        # Joining reaps: no process of ours is left a zombie. SIGKILL cannot be refused, so this wait is short
        # unless the kernel holds the process (uninterruptible I/O).
        proc.join(_KILL_WAIT_S)
        if proc.exitcode is None:
            logger.warning("%s did not exit %.0f s after SIGKILL", proc.name, _KILL_WAIT_S)


def _describe_exit(proc) -> str:
    return f"worker {proc.name.removeprefix('strata-worker')} (pid {proc.pid}) exited with code {proc.exitcode}"


class _Driver:
    """The executor's state that must outlive it for clean-up: store server, processes, step counters.

    It holds no reference to the executor, so a garbage-collected LLM still shuts its workers down.
    """

    def __init__(self, config: EngineConfig, store: dist.TCPStore, host: str, port: int, procs: list) -> None:
        self.store: dist.TCPStore | None = store
        self.host, self.port, self.procs = host, port, procs
        self.world_size = config.parallel.world_size
        self.lock = threading.Lock()
        self.submitted = 0
        self.collected = 0
        self.dead_reason: str | None = None
        self.stopping = threading.Event()
        # Shutdown writes a byte here, so the watchdog leaves its wait at once and can be joined.
        self._wake_read, self._wake_write = os.pipe()
        self.watchdog: threading.Thread | None = None
        self.closed = False

    def start_watchdog(self) -> None:
        self.watchdog = threading.Thread(target=self.watch, name="strata-executor-watchdog", daemon=True)
        self.watchdog.start()

    def watch(self) -> None:
        """Watchdog thread: a local worker's exit or any rank's reported error kills the engine."""
        try:
            client = connect_store(self.host, self.port, timedelta(seconds=10))
        except dist.DistError as e:
            logger.warning("the executor's watchdog cannot reach its store (%s); worker deaths are found late", e)
            return
        by_sentinel = {p.sentinel: p for p in self.procs}
        while not self.stopping.is_set():
            ready = multiprocessing.connection.wait([*by_sentinel, self._wake_read], timeout=0.5)
            if self.stopping.is_set():
                return
            ready = [r for r in ready if r != self._wake_read]
            try:
                error = protocol.read_error(client)
                if ready and error is None:
                    time.sleep(0.2)  # a worker that raised writes its error just before it exits
                    error = protocol.read_error(client)
            except dist.DistError:
                return  # the store is gone: we are shutting down
            if ready or error:
                reason = "; ".join(filter(None, [_describe_exit(by_sentinel[ready[0]]) if ready else None, error]))
                self.mark_dead(reason, client)
                return

    def mark_dead(self, reason: str, client: dist.TCPStore) -> None:
        with self.lock:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
            pending = range(self.collected, self.submitted)
        logger.error("a worker failed, the engine stops: %s", reason)
        try:
            protocol.mark_dead(client, pending)  # wakes up collect()
            protocol.send_step(client, self.submitted, None)  # remote workers waiting for a step leave
        except dist.DistError:
            pass
        # Survivors may be blocked on the dead rank; end them now.
        stop_processes(self.procs, grace_s=0.5)

    def shutdown(self) -> None:
        """Tell every rank to stop, wait briefly for them, then end local processes, the watchdog and the store.

        Bounded: _GOODBYE_WAIT_S for everything the ranks do on their own, then SIGTERM, then SIGKILL. The
        watchdog is joined before the store goes, so that no thread of ours is inside a store call while the
        interpreter finalizes (a daemon thread in torch's C++ code at exit can crash or hang the process).
        """
        if self.closed:
            return
        self.closed = True
        self.stopping.set()
        os.write(self._wake_write, b"x")
        deadline = time.monotonic() + _GOODBYE_WAIT_S
        try:
            client = connect_store(self.host, self.port, timedelta(seconds=_GOODBYE_WAIT_S))
            protocol.abandon_startup(client)
            protocol.send_step(client, self.submitted, None)
            while (self.dead_reason is None and protocol.num_exited(client) < self.world_size
                   and time.monotonic() < deadline):
                time.sleep(0.02)
        except dist.DistError:
            pass
        stop_processes(self.procs, grace_s=max(0.0, deadline - time.monotonic()))
        watchdog, here = self.watchdog, threading.current_thread()
        if watchdog is not None and watchdog is not here:
            watchdog.join(_WATCHDOG_JOIN_S)
        if watchdog is None or not watchdog.is_alive():
            os.close(self._wake_read)
            os.close(self._wake_write)
        elif watchdog is not here:  # it keeps its pipe while it may still wait on it
            logger.warning("the executor's watchdog did not stop within %.0f s", _WATCHDOG_JOIN_S)
        self.store = None  # the last reference: the store server stops


class MultiprocExecutor:
    """Drives tp x pp workers: `submit` hands a step to every rank without waiting; `collect` gets results."""

    def __init__(self, config: EngineConfig) -> None:
        par = config.parallel
        if par.node_rank != 0:
            raise ConfigError(f"node_rank={par.node_rank} runs headless workers only; start it with `strata serve "
                              f"MODEL --nnodes {par.nnodes} --node-rank {par.node_rank} --master-addr ADDR "
                              "--master-port PORT`", param="node_rank")
        self.config = config
        self.max_concurrent_batches = par.pipeline_parallel_size
        self._loras: dict[int, LoRARequest] = {}  # adapters every rank loaded and checked
        host = par.master_addr
        store = connect_store(host, par.master_port or 0, timedelta(seconds=_STARTUP_TIMEOUT_S), is_master=True)
        procs = spawn_workers(config, _local_ranks(config, 0), host, store.port)
        self._driver = _Driver(config, store, host, store.port, procs)
        self._finalizer = weakref.finalize(self, self._driver.shutdown)
        logger.info("started %d local workers (tp=%d x pp=%d over %d node(s)); rendezvous at %s:%d", len(procs),
                    par.tensor_parallel_size, par.pipeline_parallel_size, par.nnodes, host, store.port)
        del store  # the driver holds the only reference: dropping it at shutdown ends the server
        try:
            self.rank_infos = self._wait_for_ranks()
        except BaseException:
            self._driver.dead_reason = "start-up failed"
            self._finalizer()
            raise
        self.num_kv_blocks = min(info.max_kv_blocks for info in self.rank_infos)
        protocol.send_num_blocks(self._driver.store, self.num_kv_blocks)
        self._driver.store.set_timeout(_RESULT_TIMEOUT)
        self._driver.start_watchdog()
        if config.runner != "pooling":  # the pooling runner's ranks hold no KV cache
            logger.info("KV cache: %d blocks of %d tokens on every rank", self.num_kv_blocks,
                        config.cache.block_size)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._driver.procs]

    def _wait_for_ranks(self) -> list[RankInfo]:
        # No local variable holds the store: if start-up fails, the traceback must not keep its server alive.
        driver, world_size = self._driver, self.config.parallel.world_size
        infos: dict[int, RankInfo] = {}
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S + 60
        while True:
            for rank in range(world_size):
                info = None if rank in infos else protocol.poll_rank(driver.store, rank)
                if info is not None:
                    infos[rank] = info
            if len(infos) == world_size:
                break
            error = protocol.read_error(driver.store)
            exited = [p for p in driver.procs if p.exitcode is not None]
            if exited or error:
                # A rank reports its StrataError before the general error: look again, so that a ConfigError
                # about the checkpoint that landed after this round's poll is re-raised as itself.
                for rank in sorted(set(range(world_size)) - set(infos)):
                    protocol.poll_rank(driver.store, rank)
                reasons = [_describe_exit(p) for p in exited] + ([error] if error else [])
                script = None if error or len(infos) else unguarded_main_script()
                if script is not None:  # died before its handshake: the usual cause, named
                    raise ConfigError(f"{reasons[0]} during start-up: {guard_message(script)}", param="__main__")
                raise EngineDeadError("a worker failed during start-up: " + "; ".join(reasons))
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(infos))
                raise EngineDeadError(f"ranks {missing} did not start within {_STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        ranks = [infos[r] for r in sorted(infos)]
        _check_same_settings(self.config, ranks)
        return ranks

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Every rank loads and checks the adapter (its part of it); the first refusal is raised. An adapter every
        rank took already is not sent again: ranks reload one they evicted from its folder when a step needs it."""
        if self._loras.get(lora_request.lora_int_id) == lora_request:
            return
        self._lora_command(protocol.LoRACommand(add=lora_request))
        self._loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> None:
        self._loras.pop(lora_int_id, None)
        self._lora_command(protocol.LoRACommand(remove=lora_int_id))

    def pin_lora(self, lora_int_id: int) -> None:
        self._lora_command(protocol.LoRACommand(pin=lora_int_id))

    def _lora_command(self, command: protocol.LoRACommand) -> None:
        # Through the step sequence, so every rank applies it between the same two steps.
        n = self.submit(command)
        while (errors := protocol.take_lora_answers(self._driver.store, n, self.config.parallel.world_size)) is None:
            self._raise_if_dead()
            time.sleep(0.002)
        if errors:
            raise errors[0]

    def submit(self, out: SchedulerOutput | PoolingStep | protocol.LoRACommand) -> int:
        driver = self._driver
        with driver.lock:
            self._raise_if_dead()
            n = driver.submitted
            protocol.send_step(driver.store, n, out)
            driver.submitted += 1
        return n

    def collect(self, handle: int) -> RunnerOutput | torch.Tensor:
        driver = self._driver
        self._raise_if_dead()
        try:
            result = protocol.recv_result(driver.store, handle)
        except dist.DistError as e:
            raise EngineDeadError(f"no result from the workers for step {handle}: {e}") from e
        if result is None:
            self._raise_if_dead()
            raise EngineDeadError(f"no result from the workers for step {handle}")
        with driver.lock:
            driver.collected = handle + 1
        protocol.forget_step(driver.store, handle)
        return result

    def _raise_if_dead(self) -> None:
        if self._driver.dead_reason is not None:
            raise EngineDeadError(f"the engine's workers failed: {self._driver.dead_reason}")
        if self._driver.closed:
            raise EngineDeadError("the executor was shut down")

    def check_health(self) -> None:
        self._raise_if_dead()

    def shutdown(self) -> None:
        self._finalizer()


def _check_same_settings(config: EngineConfig, ranks: list[RankInfo]) -> None:
    ours = shared_settings(config)
    for info in ranks:
        differ = [f"{k}={info.settings.get(k)!r} (node 0: {v!r})" for k, v in ours.items() if info.settings.get(k) != v]
        if differ:
            raise ConfigError(f"rank {info.rank} on {info.host} was started with {', '.join(differ)}; start every "
                              "node with the same model and engine flags", param=differ[0].split("=")[0])


def run_headless(config: EngineConfig) -> int:
    """Node `node_rank` > 0 of a multi-node layout: run this node's ranks until node 0 ends them."""
    par = config.parallel
    if par.nnodes < 2 or par.node_rank == 0:
        raise ConfigError("headless workers are for --node-rank 1 and up of a --nnodes > 1 layout",
                          param="node_rank")
    ranks = _local_ranks(config, par.node_rank)
    procs = spawn_workers(config, ranks, par.master_addr, par.master_port)
    logger.info("node %d: started ranks %d-%d; node 0 is expected at %s:%d", par.node_rank, ranks[0], ranks[-1],
                par.master_addr, par.master_port)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main else None
    try:
        return _supervise(procs, par.master_addr, par.master_port)
    except KeyboardInterrupt:
        logger.info("node %d interrupted; stopping its workers", par.node_rank)
        stop_processes(procs, grace_s=0)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _supervise(procs: list, host: str, port: int) -> int:
    """Wait for this node's workers; one that fails is reported to node 0 and takes the others down."""
    while True:
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        if failed:
            reason = "; ".join(_describe_exit(p) for p in failed)
            logger.error("%s; stopping this node's workers", reason)
            try:
                protocol.report_error(connect_store(host, port, timedelta(seconds=2)), reason)
            except dist.DistError:
                pass  # node 0 is gone already
            stop_processes(procs, grace_s=1.0)
            return 1
        if all(p.exitcode == 0 for p in procs):
            logger.info("node 0 ended the session; workers exited")
            return 0
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=1.0)

"""One rank of the multiprocess executor: its process entry point and its step loop.

What it says to the driver, and when, is in strata.executor.protocol.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from strata.distributed import PendingSend, pp_layer_range
from strata.errors import StrataError
from strata.executor import protocol
from strata.executor.kv_budget import kv_cache_blocks
from strata.executor.model_runner import ModelRunner
from strata.executor.parallel import init_distributed
from strata.executor.pooling_runner import PoolingRunner
from strata.executor.protocol import RankInfo, WorkerSpec, connect_store, shared_settings
from strata.executor.step import PoolingStep, SchedulerOutput

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A blocking store read waits this long at most; liveness is watched by other means.
_FOREVER = timedelta(days=7)
_TEARDOWN_S = 2.0


def _watch_parent(parent_pid: int) -> None:
    """A worker whose parent is gone exits at once, whatever it is blocked in."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a spawned worker process: load, report, then run steps until told to stop."""
    import signal

    # Ctrl-C reaches the whole process group; the driver (or node agent) shuts workers down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format=LOG_FORMAT)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), name="strata-parent-watch", daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    store, reported, code = None, False, 0
    try:
        store = connect_store(spec.store_host, spec.store_port, timedelta(seconds=spec.startup_timeout_s))
        worker = Worker(spec, store)
        reported = True
        if worker.start():
            worker.run()
        else:
            code = 1
            logger.warning("%s node 0 gave up during start-up; exiting", spec.log_prefix)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the driver, then the process exits
        code = 1
        logger.error("%s worker failed: %s: %s", spec.log_prefix, type(e).__name__, e, exc_info=True)
        _report_failure(store, spec, e, startup=not reported)
    finally:
        # Leaving must not hang on a peer that is gone: whatever tear-down still runs after this long is cut short.
        exit_timer = threading.Timer(_TEARDOWN_S, os._exit, args=(code,))
        exit_timer.daemon = True
        exit_timer.start()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass
    # Everything this process owns is released; skipping the interpreter's slow teardown (seconds with
    # torch loaded) lets shutdown finish promptly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_failure(store: dist.TCPStore | None, spec: WorkerSpec, error: BaseException, startup: bool) -> None:
    if store is None:
        return
    try:
        if startup and isinstance(error, StrataError):
            protocol.report_startup_error(store, spec.rank, error)
        protocol.report_error(store, f"worker {spec.log_prefix} (rank {spec.rank}, pid {os.getpid()}) failed: "
                                     f"{type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001 - the driver may be gone; it then needs no report
        pass


class Worker:
    """One rank: its model shard, its KV cache, and the loop that runs the driver's steps in order. Under the
    pooling runner (embeddings, classifiers) a rank holds no KV cache, and its steps are PoolingSteps."""

    def __init__(self, spec: WorkerSpec, store: dist.TCPStore) -> None:
        self.spec, self.store = spec, store
        config = spec.config
        par = config.parallel
        if spec.backend == "nccl":
            self.device = torch.device("cuda", spec.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        timeout = timedelta(seconds=spec.startup_timeout_s)
        local_ranks = range(spec.rank - spec.local_rank, spec.rank - spec.local_rank + spec.num_local_ranks)
        self.pc = init_distributed(spec.rank, par.world_size, par.tensor_parallel_size, store, spec.backend, timeout,
                                   local_ranks)
        self.pooling = config.runner == "pooling"
        self.runner = PoolingRunner(config, self.pc, self.device) if self.pooling else \
            ModelRunner(config, self.pc, self.device)
        self.hidden_size = config.model.text_config.hidden_size
        self.pending: PendingSend | None = None
        self.times = {"compute": 0.0, "recv": 0.0, "send": 0.0, "idle": 0.0}  # seconds, logged at shutdown

    def start(self) -> bool:
        """Report this rank's sizes, then allocate the KV cache the driver settled on for every rank.

        False when the driver gave up during start-up (another rank failed, or the nodes disagree).
        """
        spec, runner, config = self.spec, self.runner, self.spec.config
        layers = pp_layer_range(config.model.num_layers, self.pc.pp_rank, self.pc.pp_size,
                                config.parallel.pp_layer_partition)
        info = RankInfo(rank=spec.rank, tp_rank=self.pc.tp_rank, pp_rank=self.pc.pp_rank, pid=os.getpid(),
                        host=socket.gethostname(), layers=layers, weight_bytes=0, kv_bytes_per_block=0,
                        max_kv_blocks=0, settings=shared_settings(config))
        if self.pooling:
            params = list(runner.model.named_parameters())
            info.weight_bytes = sum(p.numel() * p.element_size() for _, p in params)
            info.param_names, info.pooling = [name for name, _ in params], runner.info
        else:
            info.weight_bytes, info.param_names = runner.weight_bytes, runner.param_names
            info.kv_bytes_per_block = per_block = runner.kv_bytes_per_block()
            info.max_kv_blocks = kv_cache_blocks(config, per_block, self.device, spec.num_local_ranks,
                                                 runner.state_bytes())
        protocol.report_ready(self.store, info)
        num_blocks = protocol.recv_num_blocks(self.store)
        if num_blocks < 0:
            return False
        if not self.pooling:
            runner.allocate_kv_cache(num_blocks)
        self.store.set_timeout(_FOREVER)
        logger.info("%s ready: layers %d-%d, %d KV blocks", spec.log_prefix, info.layers[0], info.layers[1] - 1,
                    num_blocks)
        return True

    def run(self) -> None:
        n = 0
        while True:
            started = time.perf_counter()
            step = protocol.recv_step(self.store, n)
            self.times["idle"] += time.perf_counter() - started
            if step is None:
                break
            if isinstance(step, protocol.LoRACommand):
                self.lora_command(n, step)
            elif isinstance(step, PoolingStep):
                self.pool(n, step)
            else:
                self.execute(n, step)
            n += 1
        if self.pending is not None:
            self.pending.wait()
        protocol.report_exit(self.store)
        t = self.times
        logger.info("%s shut down after %d steps: %.2f s computing, %.2f s waiting for the previous stage, "
                    "%.2f s for the next stage to take a batch, %.2f s for steps", self.spec.log_prefix, n,
                    t["compute"], t["recv"], t["send"], t["idle"])

    def lora_command(self, n: int, command: protocol.LoRACommand) -> None:
        """Load (or forget) an adapter on this rank: its part of the adapter's layers; a refusal is answered."""
        error = None
        try:
            if command.add is not None:
                self.runner.add_lora(command.add)
            elif command.pin is not None:
                self.runner.pin_lora(command.pin)
            else:
                self.runner.remove_lora(command.remove)
        except StrataError as e:
            error = e
        protocol.send_lora_answer(self.store, n, self.spec.rank, error)

    def pool(self, n: int, step: PoolingStep) -> None:
        """A pooling batch: every rank runs the whole batch (one stage), TP rank 0 answers with its tensor."""
        started = time.perf_counter()
        result = self.runner.run(step)
        self.times["compute"] += time.perf_counter() - started
        if self.pc.tp_rank == 0:
            protocol.send_result(self.store, n, result)

    def execute(self, n: int, step: SchedulerOutput) -> None:
        pc, t = self.pc, self.times
        intermediate = None
        started = time.perf_counter()
        if not pc.is_first_stage and step.requests:
            intermediate = pc.recv_intermediate(step.num_tokens, self.hidden_size, self.spec.config.model.dtype,
                                                self.device)
        received = time.perf_counter()
        runner = self.runner
        result = runner.execute(step, intermediate) if pc.is_last_stage else runner.execute_stage(step, intermediate)
        computed = time.perf_counter()
        t["recv"] += received - started
        t["compute"] += computed - received
        if not pc.is_last_stage:
            if step.requests:
                # At most one send in flight: this stage may start its next batch before the next stage
                # has taken this one, which is what lets the stages overlap.
                if self.pending is not None:
                    self.pending.wait()
                self.pending = pc.send_intermediate(result)
            t["send"] += time.perf_counter() - computed
        elif pc.tp_rank == 0:
            protocol.send_result(self.store, n, result)

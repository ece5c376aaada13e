"""The control protocol between the multiprocess executor's driver and its ranks, in the order it is spoken.

Control messages are pickled into the TCPStore that node 0's driver hosts; tensors travel only through
torch.distributed (TP collectives, PP hand-off between stages).

1. The driver spawns each of its node's ranks with a `WorkerSpec` (other nodes' ranks are started by
   `strata serve --node-rank R`, which builds the same spec from its own command line).
2. Each rank loads its shard and answers `init/<rank>`: its `RankInfo`, or the `StrataError` that stopped it.
3. The driver checks that every rank runs the same settings and writes the KV cache size every rank allocates
   to `num_kv_blocks` (-1: start-up was abandoned, ranks leave).
4. For each step n the driver writes `step/<n>`: a SchedulerOutput, or None to tell every rank to leave.
   The last stage's TP rank 0 answers `out/<n>` with a RunnerOutput. Once the driver read it, it deletes both
   keys so the store stays small. When a worker died, the driver writes DEAD_MARKER there instead, waking
   its own reader. A `LoRACommand` may stand in for a step: every rank loads (or forgets) the adapter and answers
   `lora/<n>/<rank>` (None, or the StrataError that refused it). Under the pooling runner the steps are
   PoolingSteps and the results float32 tensors (embeddings or logits); ranks allocate no KV cache (0 blocks).
5. A rank that fails writes its reason to `error`; each rank that leaves in order adds one to `exited`.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from strata.config import EngineConfig
from strata.distributed import rank_layout
from strata.errors import StrataError
from strata.executor.model_runner import RunnerOutput
from strata.executor.step import PoolingStep, SchedulerOutput
from strata.lora.request import LoRARequest

if TYPE_CHECKING:
    from strata.executor.pooling_runner import PoolingInfo


def connect_store(host: str, port: int, timeout: timedelta, is_master: bool = False) -> dist.TCPStore:
    """A TCPStore client (or the server, on node 0's driver); connecting retries until `timeout`."""
    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False, timeout=timeout)


# 1. Spawning a rank.


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned worker needs; pickled into the new process."""

    config: EngineConfig
    rank: int
    local_rank: int
    num_local_ranks: int
    store_host: str
    store_port: int
    parent_pid: int
    num_threads: int
    backend: str  # gloo | nccl
    log_level: int = logging.INFO
    startup_timeout_s: float = 600.0

    @property
    def log_prefix(self) -> str:
        tp_rank, pp_rank = rank_layout(self.config.parallel.tensor_parallel_size, self.rank)
        return f"[tp{tp_rank} pp{pp_rank}]"


# 2. A rank reports once its weights are loaded.


@dataclass
class RankInfo:
    """What a rank reports once its weights are loaded."""

    rank: int
    tp_rank: int
    pp_rank: int
    pid: int
    host: str
    layers: tuple[int, int]
    weight_bytes: int
    kv_bytes_per_block: int
    max_kv_blocks: int
    settings: dict[str, object] = field(default_factory=dict)
    param_names: list[str] = field(default_factory=list)
    pooling: PoolingInfo | None = None  # the pooling runner's model, as the engine reads it


def shared_settings(config: EngineConfig) -> dict[str, object]:
    """Settings every node must agree on; each node parses its own command line, so they are compared."""
    par = config.parallel
    return {"architecture": config.model.architecture, "dtype": str(config.model.dtype).removeprefix("torch."),
            "tensor_parallel_size": par.tensor_parallel_size, "pipeline_parallel_size": par.pipeline_parallel_size,
            "pp_layer_partition": par.pp_layer_partition, "nnodes": par.nnodes,
            "block_size": config.cache.block_size, "max_model_len": config.model.max_model_len,
            "quantization": config.model.quantization, "seed": config.seed}


def _init_key(rank: int) -> str:
    return f"init/{rank}"


def report_ready(store: dist.Store, info: RankInfo) -> None:
    store.set(_init_key(info.rank), pickle.dumps(("ok", info)))


def report_startup_error(store: dist.Store, rank: int, error: StrataError) -> None:
    """The driver re-raises it as is (e.g. a ConfigError about the checkpoint)."""
    store.set(_init_key(rank), pickle.dumps(("error", (type(error), error.message, error.param))))


def poll_rank(store: dist.Store, rank: int) -> RankInfo | None:
    """The rank's RankInfo once it reported, None before; re-raises the StrataError it reported instead."""
    if not store.check([_init_key(rank)]):
        return None
    status, payload = pickle.loads(store.get(_init_key(rank)))
    if status == "error":
        cls, message, param = payload
        raise cls(message, param=param)
    return payload


# 3. The KV cache size every rank allocates.

NUM_BLOCKS_KEY = "num_kv_blocks"


def send_num_blocks(store: dist.Store, num_blocks: int) -> None:
    store.set(NUM_BLOCKS_KEY, str(num_blocks))


def abandon_startup(store: dist.Store) -> None:
    """Ranks still starting wait for the KV cache size, not for a step; -1 sends them away."""
    if not store.check([NUM_BLOCKS_KEY]):
        send_num_blocks(store, -1)


def recv_num_blocks(store: dist.Store) -> int:
    """The number of KV blocks to allocate; negative when the driver gave up during start-up."""
    return int(store.get(NUM_BLOCKS_KEY))


# 4. Steps and their results.

DEAD_MARKER = b"\x00strata-dead"  # in place of a result that will never come


def _step_key(n: int) -> str:
    return f"step/{n}"


def _out_key(n: int) -> str:
    return f"out/{n}"


@dataclass(frozen=True)
class LoRACommand:
    """In place of a step: every rank loads and checks `add` (or forgets the adapter of id `remove`, or keeps the one
    of id `pin` in host memory until it is removed), then answers."""

    add: LoRARequest | None = None
    remove: int | None = None
    pin: int | None = None


def send_step(store: dist.Store, n: int, step: SchedulerOutput | PoolingStep | LoRACommand | None) -> None:
    """Step n for every rank; None tells the ranks to leave."""
    store.set(_step_key(n), pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))


def recv_step(store: dist.Store, n: int) -> SchedulerOutput | PoolingStep | LoRACommand | None:
    return pickle.loads(store.get(_step_key(n)))


def _lora_key(n: int, rank: int) -> str:
    return f"lora/{n}/{rank}"


def send_lora_answer(store: dist.Store, n: int, rank: int, error: StrataError | None) -> None:
    payload = None if error is None else (type(error), error.message, error.param)
    store.set(_lora_key(n, rank), pickle.dumps(payload))


def take_lora_answers(store: dist.Store, n: int, world_size: int) -> list[StrataError] | None:
    """None until every rank answered command n; then the errors they refused it with (the keys are deleted)."""
    keys = [_lora_key(n, rank) for rank in range(world_size)]
    if not store.check(keys):
        return None
    answers = [pickle.loads(store.get(key)) for key in keys]
    for key in [*keys, _step_key(n)]:
        store.delete_key(key)
    return [cls(message, param=param) for cls, message, param in filter(None, answers)]


def send_result(store: dist.Store, n: int, result: RunnerOutput | torch.Tensor) -> None:
    store.set(_out_key(n), pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


def mark_dead(store: dist.Store, steps: range) -> None:
    """Stand in for results that will never come (a worker died), waking whoever waits for them."""
    for n in steps:
        store.set(_out_key(n), DEAD_MARKER)


def recv_result(store: dist.Store, n: int) -> RunnerOutput | torch.Tensor | None:
    """Step n's result, waiting for it; None when it will never come (a worker died)."""
    raw = store.get(_out_key(n))
    return None if raw == DEAD_MARKER else pickle.loads(raw)


def forget_step(store: dist.Store, n: int) -> None:
    store.delete_key(_out_key(n))
    store.delete_key(_step_key(n))


# 5. Failures and goodbyes.

ERROR_KEY = "error"
EXITED_KEY = "exited"


def report_error(store: dist.Store, reason: str) -> None:
    store.set(ERROR_KEY, reason)


def read_error(store: dist.Store) -> str | None:
    return store.get(ERROR_KEY).decode() if store.check([ERROR_KEY]) else None


def report_exit(store: dist.Store) -> None:
    store.add(EXITED_KEY, 1)


def num_exited(store: dist.Store) -> int:
    return store.add(EXITED_KEY, 0)

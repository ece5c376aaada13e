"""Executors run a step on every rank: UniprocExecutor in this process (TP=PP=1)."""
from __future__ import annotations

import logging

from strata.config import EngineConfig, resolve_device
from strata.distributed import ParallelContext
from strata.executor.kv_budget import kv_cache_blocks
from strata.executor.model_runner import ModelRunner, RunnerOutput
from strata.executor.step import SchedulerOutput
from strata.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class UniprocExecutor:
    """Runs the whole model in the calling process."""

    max_concurrent_batches = 1

    def __init__(self, config: EngineConfig) -> None:
        device = resolve_device(config.device)
        self.runner = ModelRunner(config, ParallelContext(), device)
        self.num_kv_blocks = kv_cache_blocks(config, self.runner.kv_bytes_per_block(), device,
                                             state_bytes=self.runner.state_bytes())
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_kv_blocks,
                    config.cache.block_size, self.num_kv_blocks * self.runner.kv_bytes_per_block() / 2**20)

    def submit(self, out: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(out)

    def collect(self, handle: RunnerOutput) -> RunnerOutput:
        return handle

    def add_lora(self, lora_request: LoRARequest) -> None:
        self.runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.remove_lora(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> None:
        self.runner.pin_lora(lora_int_id)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig):
    if config.parallel.world_size == 1 and config.parallel.nnodes == 1:
        return UniprocExecutor(config)
    from strata.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)

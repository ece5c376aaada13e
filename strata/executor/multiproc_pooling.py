"""The pooling runner over TP worker processes: the multiprocess executor's ranks each load their shard of the encoder
(or converted decoder) and run every batch together; the driver side looks like a PoolingRunner to the engine."""
from __future__ import annotations

import torch

from strata.config import EngineConfig
from strata.executor.multiproc import MultiprocExecutor
from strata.executor.pooling_runner import PoolingRunner
from strata.executor.step import PoolingStep


class MultiprocPoolingRunner:
    """`embed` and `classify` of a PoolingRunner, run by tensor_parallel_size worker processes; a worker that dies
    is an EngineDeadError (the executor's watchdog), never a hang."""

    def __init__(self, config: EngineConfig) -> None:
        self.executor = MultiprocExecutor(config)
        info = self.executor.rank_infos[0].pooling
        self.num_labels, self.pooling = info.num_labels, info.pooling
        self.hidden_size, self.max_positions = info.hidden_size, info.max_positions

    def embed(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B, hidden] float32 embeddings, pooled (and normalized) as the checkpoint says."""
        return self._run(PoolingStep("embed", sequences))

    def classify(self, sequences: list[list[int]], token_types: list[list[int]] | None = None) -> torch.Tensor:
        """[B, num_labels] float32 logits of a sequence classifier."""
        return self._run(PoolingStep("classify", sequences, token_types))

    def _run(self, step: PoolingStep) -> torch.Tensor:
        return self.executor.collect(self.executor.submit(step))

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()


def create_pooling_runner(config: EngineConfig) -> PoolingRunner | MultiprocPoolingRunner:
    """In this process when one rank serves the model, else over the multiprocess executor's workers."""
    if config.parallel.world_size == 1 and config.parallel.nnodes == 1:
        return PoolingRunner(config)
    return MultiprocPoolingRunner(config)

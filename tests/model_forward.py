"""One forward pass of strata's model runner over a single prompt, for comparing logits with references."""
from __future__ import annotations

import torch

from strata import SamplingParams
from strata.config import EngineConfig
from strata.distributed import ParallelContext
from strata.executor.model_runner import ModelRunner
from strata.executor.step import NewRequestData, ScheduledRequest, SchedulerOutput


def strata_logits(path, token_ids: list[int], pc: ParallelContext | None = None, **engine_args) -> torch.Tensor:
    """Logits of every position of one prompt (float32, CPU); `engine_args` as EngineConfig.create takes them."""
    config = EngineConfig.create(str(path), dtype="float32", device="cpu", **engine_args)
    runner = ModelRunner(config, pc or ParallelContext(), torch.device("cpu"))
    runner.allocate_kv_cache(16)
    blocks = list(range(-(-len(token_ids) // config.cache.block_size)))
    step = SchedulerOutput([ScheduledRequest("r", token_ids, 0, blocks, True,
                                             new=NewRequestData(SamplingParams(), token_ids))])
    runner._update_states(step)
    with torch.inference_mode():
        input_ids, positions, meta = runner._prepare(step.requests)
        return runner.model.compute_logits(runner.model(input_ids, positions, meta))

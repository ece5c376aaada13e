"""How many KV blocks a rank gets: the cache budget (given, or a share of free memory) after Mamba state slots."""
from __future__ import annotations

import torch

from strata.config import EngineConfig, default_cpu_kv_cache_bytes
from strata.errors import ConfigError


def kv_cache_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device,
                    num_local_ranks: int = 1, state_bytes: int = 0) -> int:
    """How many KV blocks this rank gets: from kv_cache_memory, or a share of free (GPU) memory, after the
    Mamba state slots (`state_bytes`, one per schedulable sequence) have taken their part."""
    sched, bs = config.scheduler, config.cache.block_size
    # Never more than every sequence at full length could use.
    useful = config.scheduler.max_num_seqs * (-(-sched.max_model_len // bs) + 1)
    budget = config.cache.kv_cache_memory
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Keep a margin for activations and logits of the largest step.
        budget = int(total * config.cache.gpu_memory_utilization - (total - free) - 0.05 * total)
    elif budget is None:
        budget = default_cpu_kv_cache_bytes(num_local_ranks)
    if state_bytes and state_bytes > budget:
        per_seq = state_bytes // sched.max_num_seqs
        raise ConfigError(
            f"the Mamba state of max_num_seqs={sched.max_num_seqs} sequences takes {state_bytes / 2**20:.1f} MiB, "
            f"more than the cache budget of {budget / 2**20:.1f} MiB; lower --max-num-seqs to at most "
            f"{budget // per_seq} or raise --kv-cache-memory / --gpu-memory-utilization", param="max_num_seqs")
    budget -= state_bytes
    if bytes_per_block == 0:
        return useful
    num_blocks = min(budget // bytes_per_block, useful)
    needed = -(-sched.max_model_len // bs)
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache holds {num_blocks * bs} tokens ({budget / 2**20:.1f} MiB), fewer than one "
            f"sequence of max_model_len={sched.max_model_len}; lower --max-model-len or raise "
            f"--kv-cache-memory / --gpu-memory-utilization", param="max_model_len")
    return int(num_blocks)

"""Process groups for one rank: joining the torch.distributed world, its TP group and shared-memory channels."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch.distributed as dist

from strata.distributed import ParallelContext, rank_layout
from strata.executor.shm_collectives import SharedMemoryChannel, SharedMemoryGroup


def init_distributed(rank: int, world_size: int, tp_size: int, store: dist.Store, backend: str,
                     timeout: timedelta, local_ranks: range | None = None) -> ParallelContext:
    """Join the torch.distributed world through `store` and build this rank's TP group. On gloo, a TP group
    whose ranks are all in `local_ranks` (this machine's), and stages next to each other on this machine,
    talk through shared memory."""
    dist.init_process_group(backend, store=dist.PrefixStore("strata/pg/", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    tp_rank, pp_rank = rank_layout(tp_size, rank)
    tp_group = None
    if tp_size > 1:
        # Every rank must create every group, in the same order.
        for stage in range(world_size // tp_size):
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp_rank:
                tp_group = group
    pc = ParallelContext(tp_rank, tp_size, pp_rank, world_size // tp_size, tp_group, dist.group.WORLD)
    if backend != "gloo" or local_ranks is None:
        return pc
    first, seconds = pp_rank * tp_size, timeout.total_seconds()
    tp_shm = None
    if tp_group is not None and first in local_ranks and first + tp_size - 1 in local_ranks:
        tp_shm = SharedMemoryGroup.create(tp_rank, tp_size, tp_group, seconds)
    send_to = pc.stage_rank(pp_rank + 1) if not pc.is_last_stage else None
    recv_from = pc.stage_rank(pp_rank - 1) if not pc.is_first_stage else None
    sending, receiving = SharedMemoryChannel.open_pair(
        store, rank, send_to if send_to in local_ranks else None, recv_from if recv_from in local_ranks else None,
        seconds)
    return dataclasses.replace(pc, tp_shm=tp_shm, send_channel=sending, recv_channel=receiving)

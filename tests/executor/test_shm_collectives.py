"""Shared-memory TP collectives (the same sums and gathers as gloo, identical bits on every rank) and PP
hand-off channels (byte-exact, in order, whatever the size)."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from processes import leave_process_group, spawn_ranks

from strata.distributed import IntermediateTensors
from strata.executor import shm_collectives
from strata.executor.parallel import init_distributed
from strata.kernels.cpu import collectives

pytestmark = pytest.mark.skipif(collectives.library() is None, reason="no C compiler to build the library")


def _tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _rank_main(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    pc = init_distributed(rank, world, world, store, "gloo", timedelta(seconds=60), local_ranks=range(world))
    assert pc.tp_shm is not None
    # A slot holds 1 MiB: 300,000 floats take two rounds.
    for shape in [(1,), (7, 33), (300_000,)]:
        x = _tensor(rank, shape)
        expected = _tensor(0, shape)
        for r in range(1, world):
            expected = expected + _tensor(r, shape)
        assert pc.all_reduce(x) is x
        assert torch.equal(x, expected), shape  # rank order on every rank: the same bits as this sum
    for shape, dtype in [((3, 5), torch.float32), ((4, 2), torch.int64), ((2, 200_000), torch.float32)]:
        gathered = pc.all_gather(_tensor(rank, shape, dtype), dim=-1)
        assert torch.equal(gathered, torch.cat([_tensor(r, shape, dtype) for r in range(world)], dim=-1))
    # bfloat16: summed in float32 in rank order, rounded once; beyond one slot too (600,000 x 2 bytes).
    for shape in [(16,), (600_000,)]:
        y = _tensor(rank, shape, torch.bfloat16)
        expected = _tensor(0, shape, torch.bfloat16).float()
        for r in range(1, world):
            expected = expected + _tensor(r, shape, torch.bfloat16).float()
        assert torch.equal(pc.all_reduce(y), expected.bfloat16())
    # Other dtypes are left to gloo.
    assert not pc.tp_shm.all_reduce(torch.ones(4, dtype=torch.float16))
    assert torch.equal(pc.all_reduce(torch.ones(4, dtype=torch.float16)), torch.full((4,), float(world)).half())
    leave_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_all_reduce_and_all_gather_match_the_sums(world):
    spawn_ranks(_rank_main, world, lambda port: (world, port))


def _one_rank_per_machine_main(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    pc = init_distributed(rank, world, world, store, "gloo", timedelta(seconds=60), local_ranks=range(rank, rank + 1))
    assert pc.tp_shm is None
    x = _tensor(rank, (5,))
    torch.testing.assert_close(pc.all_reduce(x), _tensor(0, (5,)) + _tensor(1, (5,)))
    leave_process_group()


def test_tp_groups_spanning_machines_keep_gloo():
    spawn_ranks(_one_rank_per_machine_main, 2, lambda port: (2, port))


def _stages_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    pc = init_distributed(rank, 2, 1, store, "gloo", timedelta(seconds=60), local_ranks=range(2))
    assert (pc.send_channel is not None) == (rank == 0) and (pc.recv_channel is not None) == (rank == 1)
    # Sizes around the 4 MiB slots and beyond all four of them (the sender then waits for the receiver).
    shapes = [(2, 1, 8), (2, 300, 2048), (2, 1, 8), (2, 1300, 2048), (2, 5, 3)]
    for i, shape in enumerate(shapes):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        expected = _tensor(i, shape, dtype)
        if rank == 0:
            pc.send_intermediate(IntermediateTensors(expected[0], expected[1])).wait()
        else:
            got = pc.recv_intermediate(shape[1], shape[2], dtype, torch.device("cpu"))
            assert torch.equal(got.hidden_states, expected[0]) and torch.equal(got.residual, expected[1])
    leave_process_group()


def test_stage_hand_off_through_shared_memory_is_exact_and_in_order():
    spawn_ranks(_stages_main, 2, lambda port: (port,))


def _no_room_main(rank: int, tp_size: int, port: int) -> None:
    import errno

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    shm_collectives.os.posix_fallocate = full  # this process only
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    pc = init_distributed(rank, 2, tp_size, store, "gloo", timedelta(seconds=60), local_ranks=range(2))
    assert pc.tp_shm is None and pc.send_channel is None and pc.recv_channel is None
    if tp_size == 2:
        torch.testing.assert_close(pc.all_reduce(_tensor(rank, (5,))), _tensor(0, (5,)) + _tensor(1, (5,)))
    elif rank == 0:
        pc.send_intermediate(IntermediateTensors(_tensor(0, (3, 4)), _tensor(1, (3, 4)))).wait()
    else:
        got = pc.recv_intermediate(3, 4, torch.float32, torch.device("cpu"))
        assert torch.equal(got.hidden_states, _tensor(0, (3, 4)))
    leave_process_group()


@pytest.mark.parametrize("tp_size", [2, 1])
def test_a_full_shared_memory_falls_back_to_gloo(tp_size):
    spawn_ranks(_no_room_main, 2, lambda port: (tp_size, port))

"""TP collectives and the PP hand-off through shared memory, for ranks of one machine on CPU.

gloo moves even a 2 KB all-reduce through loopback TCP in about a millisecond here (a Llama step does two
per layer), and a stage hand-off in several; a shared segment does either in microseconds plus the copy.
Built on `strata/kernels/cpu/csrc/shm_collectives.c` (bindings: strata/kernels/cpu/collectives.py).
"""
from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist

from strata.kernels.cpu import collectives, cpu_kernels_apply
from strata.kernels.cpu.abi import SHM_HEADER_BYTES as _HEADER_BYTES

logger = logging.getLogger(__name__)

_SLOT_BYTES = 1 << 20  # per rank and buffer; larger tensors go through in several rounds
_CHANNEL_SLOT_BYTES, _CHANNEL_DEPTH = 4 << 20, 4


def _new_segment_path() -> str:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"strata-{uuid.uuid4().hex}")


def _create_segment(path: str, nbytes: int) -> bool:
    """A zero-filled segment (nothing published yet) with its memory reserved now: a full /dev/shm (64 MiB in
    a default container) then fails here, instead of killing a rank with SIGBUS mid-step. False if so."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # no way to reserve here (not Linux): a sparse file
            os.ftruncate(fd, nbytes)
        return True
    except OSError as e:
        os.unlink(path)
        logger.warning("no room for a %.0f MiB shared-memory segment in %s (%s); these ranks talk through gloo",
                       nbytes / 2**20, os.path.dirname(path), e)
        return False
    finally:
        os.close(fd)


def _map_segment(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _check(status: int, what: str, timeout_s: float) -> None:
    if status != 0:
        raise RuntimeError(f"{what} through shared memory: the peer rank did not arrive within {timeout_s:.0f} s")


class SharedMemoryGroup:
    """One TP group's segment, mapped by each of its ranks; calls must come in the same order on all."""

    def __init__(self, lib: ctypes.CDLL, segment: torch.Tensor, rank: int, size: int, timeout_s: float) -> None:
        self.lib, self.segment, self.rank, self.size, self.timeout_s = lib, segment, rank, size, timeout_s
        self.base = segment.data_ptr()
        self.op = ctypes.c_int64(0)
        self.reducers = {torch.float32: lib.shm_all_reduce_f32, torch.bfloat16: lib.shm_all_reduce_bf16}

    @classmethod
    def create(cls, rank: int, size: int, group: Any, timeout_s: float) -> SharedMemoryGroup | None:
        """Collective over `group`: rank 0 makes the segment, everyone maps it, then its name is removed
        (the mappings keep it alive and nothing is left behind). None when the library cannot be built or
        shared memory has no room."""
        lib = collectives.library()
        if lib is None or size > _HEADER_BYTES // 64:  # every rank decides alike; one 64-byte flag per rank
            return None
        nbytes = _HEADER_BYTES + 2 * size * _SLOT_BYTES
        names = [None]
        if rank == 0:
            path = _new_segment_path()
            names = [path if _create_segment(path, nbytes) else None]
        dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
        if names[0] is None:  # every rank of the group learns it together
            return None
        segment = _map_segment(names[0], nbytes)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(names[0])
        return cls(lib, segment, rank, size, timeout_s)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sums `x` in place over the group (bfloat16 in float32, rounded once); False (nothing done) for
        tensors it does not handle."""
        reduce = self.reducers.get(x.dtype)
        if reduce is None or not cpu_kernels_apply(x) or not x.is_contiguous():
            return False
        status = reduce(self.base, self.rank, self.size, _SLOT_BYTES, ctypes.byref(self.op), x.data_ptr(), x.numel(),
                        self.timeout_s)
        _check(status, "TP all-reduce", self.timeout_s)
        return True

    def all_gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[size, *x.shape]: every rank's `x` in rank order; None for tensors it does not handle."""
        if not cpu_kernels_apply(x) or x.numel() == 0:
            return None
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype)
        nbytes = x.numel() * x.element_size()
        status = self.lib.shm_all_gather(self.base, self.rank, self.size, _SLOT_BYTES, ctypes.byref(self.op),
                                         x.data_ptr(), nbytes, out.data_ptr(), self.timeout_s)
        _check(status, "TP all-gather", self.timeout_s)
        return out


class SharedMemoryChannel:
    """One direction between two ranks (a stage and the next): byte-exact copies of tensors, in order."""

    def __init__(self, lib: ctypes.CDLL, segment: torch.Tensor, timeout_s: float) -> None:
        self.lib, self.segment, self.timeout_s = lib, segment, timeout_s
        self.base = segment.data_ptr()
        self.count = ctypes.c_int64(0)  # pieces sent (sender) or received (receiver) so far

    @staticmethod
    def _key(sender: int, receiver: int) -> str:
        return f"strata/shm/channel/{sender}-{receiver}"

    @classmethod
    def open_pair(cls, store: dist.Store, rank: int, send_to: int | None, recv_from: int | None,
                  timeout_s: float) -> tuple[SharedMemoryChannel | None, SharedMemoryChannel | None]:
        """This rank's (sending, receiving) channels, set up through `store` with the peers doing the same;
        each segment's name is removed once both ends have mapped it."""
        lib, nbytes = collectives.library(), _HEADER_BYTES + _CHANNEL_DEPTH * _CHANNEL_SLOT_BYTES
        if lib is None:
            return None, None
        sending = receiving = None
        if send_to is not None:
            path = _new_segment_path()
            if _create_segment(path, nbytes):
                sending = cls(lib, _map_segment(path, nbytes), timeout_s)
            store.set(cls._key(rank, send_to), path if sending is not None else "")  # "": the pair uses gloo
        if recv_from is not None:
            key = cls._key(recv_from, rank)
            their_path = store.get(key).decode()
            if their_path:
                receiving = cls(lib, _map_segment(their_path, nbytes), timeout_s)
            store.set(key + "/mapped", "1")
        if sending is not None:
            store.get(cls._key(rank, send_to) + "/mapped")
            os.unlink(path)
        return sending, receiving

    def send(self, x: torch.Tensor) -> None:
        """Returns once `x` (contiguous) is copied out; blocks only while the receiver is far behind."""
        status = self.lib.shm_send(self.base, _CHANNEL_SLOT_BYTES, _CHANNEL_DEPTH, ctypes.byref(self.count),
                                   x.data_ptr(), x.numel() * x.element_size(), self.timeout_s)
        _check(status, "stage hand-off", self.timeout_s)

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        status = self.lib.shm_recv(self.base, _CHANNEL_SLOT_BYTES, _CHANNEL_DEPTH, ctypes.byref(self.count),
                                   out.data_ptr(), out.numel() * out.element_size(), self.timeout_s)
        _check(status, "stage hand-off", self.timeout_s)
        return out

"""Bindings of the shared-memory collectives (csrc/shm_collectives.c): all-reduce and all-gather among the ranks of
one machine, and a one-way channel between two of them, each spinning on flags in a shared segment."""
from __future__ import annotations

import ctypes
import functools

from strata.kernels.cpu import build
from strata.kernels.cpu.abi import I32, I64, PTR

F64 = ctypes.c_double


@functools.cache
def library() -> ctypes.CDLL | None:
    reduce = ([PTR, I32, I32, I64, PTR, PTR, I64, F64], I32)
    channel = ([PTR, I64, I64, PTR, PTR, I64, F64], I32)
    return build.bind("shm_collectives", {"shm_all_reduce_f32": reduce, "shm_all_reduce_bf16": reduce,
                                          "shm_all_gather": ([PTR, I32, I32, I64, PTR, PTR, I64, PTR, F64], I32),
                                          "shm_send": channel, "shm_recv": channel})

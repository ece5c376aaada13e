"""Process helpers for tests that start workers or servers: free ports, liveness and descendants from /proc."""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(main: Callable, nprocs: int, args_for_port: Callable[[int], tuple], tries: int = 3) -> None:
    """mp.spawn(main, args_for_port(port)) on a port found free. Rank 0 binds it seconds later, when another
    process may have taken it: only that failure (EADDRINUSE in a rank's traceback) is tried again, on a new port."""
    for attempt in range(tries):
        try:
            mp.spawn(main, args=args_for_port(free_port()), nprocs=nprocs)
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == tries - 1:
                raise


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return [p for p in found if alive(p)]


def spawned_workers(pid: int) -> list[int]:
    """The multiprocessing-spawned processes below `pid` (not multiprocessing's resource tracker)."""
    found = []
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(child)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found



def wait_reaped(pids: list[int], timeout_s: float) -> list[int]:
    """The pids that still exist after waiting up to `timeout_s`, running or as zombies nobody waited for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


def leave_process_group() -> None:
    """End a spawned test rank's torch.distributed membership. The barrier keeps rank 0 (whose TCPStore every
    rank talks through) from tearing the store down while a peer still uses it: without it a rank now and then
    aborts at exit ("terminate called without an active exception") on a loaded 2-core machine."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()

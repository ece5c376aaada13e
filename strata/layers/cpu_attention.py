"""Decode attention straight from the paged KV cache on CPU, as a small C kernel compiled on first use.

Gathering every sequence's blocks into a padded batch for SDPA copies the whole context once per layer and
step, which on CPU costs more than the attention itself; the kernel reads the blocks in place instead.
Without a C compiler, attention keeps the gather path (a warning says so).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.c")
# -march=native: the library is built on, and cached for, the machine that runs it.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def _cache_dir() -> Path:
    root = os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join([compiler, *_FLAGS]).encode(), platform.machine().encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"cpu_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several worker processes may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention gathers the KV cache (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("could not build the CPU attention kernel, decode attention gathers the KV cache "
                       "(slower): %s", detail)
        return None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_decode_attention.argtypes = [pointer] * 6 + [i64] * 6 + [ctypes.c_float, pointer, ctypes.c_int]
    lib.paged_decode_attention.restype = ctypes.c_int
    return lib


def available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer's decodes (float32 on CPU, compiler present)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and _library() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, first_keys: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q: [S, Hq, D]; caches: [blocks, block_size, Hkv, D]; block_tables: [S, max_blocks] int32;
    sequence s attends keys first_keys[s] .. seq_lens[s] - 1 (int32). Returns [S, Hq, D]."""
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    status = _library().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), first_keys.data_ptr(),
        seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        scale, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("CPU attention kernel could not allocate its scratch memory")
    return out

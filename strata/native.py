"""strata's small C libraries (strata/csrc): compiled on first use with the system's C compiler, cached per
machine, loaded with ctypes. Threads come from the OpenMP runtime torch already loaded."""
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
from typing import Any

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).with_name("csrc")
# -march=native: a library is built on, and cached for, the machine that runs it.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    root = os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(name: str, compiler: str) -> Path:
    source = _SOURCES / f"{name}.c"
    headers = [h.read_bytes() for h in sorted(_SOURCES.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join([compiler, *_FLAGS]).encode(),
                                     platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several worker processes may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# ctypes argument types, so that signatures read like the C ones.
PTR, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def bind(name: str, signatures: dict[str, tuple[list, Any]]) -> ctypes.CDLL | None:
    """`load(name)` with each function's (argument types, result type) declared, so ctypes converts and checks
    the arguments of every call; None when the library cannot be built here."""
    lib = load(name)
    if lib is not None:
        for function, (argtypes, restype) in signatures.items():
            getattr(lib, function).argtypes, getattr(lib, function).restype = argtypes, restype
    return lib


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from csrc/<name>.c, or None (with a warning) when it cannot be built here."""
    import torch  # noqa: F401 - torch's OpenMP runtime must be loaded first, so the library shares it

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: %s runs its slower plain-torch path", name)
        return None
    try:
        return ctypes.CDLL(str(_build(name, compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not build %s, its slower plain-torch path runs instead: %s", name,
                       getattr(e, "stderr", "") or e)
        return None

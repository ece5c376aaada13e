"""strata's C libraries (csrc/<name>.c): compiled on first use with the system's C compiler, cached per machine,
loaded with ctypes and checked against abi.py. Threads come from the OpenMP runtime torch already loaded."""
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

from strata.errors import ConfigError
from strata.kernels.cpu import abi

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
# -march=native: a library is built on, and cached for, the machine that runs it.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# STRATA_KERNEL_MARCH builds for an x86-64 level instead (e.g. the AVX2 kernels measured on an AVX-512 machine), each
# with the CPU flags it needs to run here.
_MARCH_NEEDS = {"native": set(),
                "x86-64-v2": {"sse4_2", "popcnt"},
                "x86-64-v3": {"avx2", "fma", "f16c", "bmi2", "movbe"},
                "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}


def cache_dir() -> Path:
    root = os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def compiler_flags() -> list[str]:
    """The flags the C libraries are built with: -march=native, or STRATA_KERNEL_MARCH's x86-64 level (refused with
    ConfigError where it is unknown or this CPU cannot run it)."""
    march = os.environ.get("STRATA_KERNEL_MARCH", "native")
    if march == "native":
        return _FLAGS
    if march not in _MARCH_NEEDS:
        raise ConfigError(f"STRATA_KERNEL_MARCH={march!r}: expected one of {', '.join(_MARCH_NEEDS)}")
    lacking = sorted(_MARCH_NEEDS[march] - set(_cpu_signature().split()))
    if platform.machine() not in ("x86_64", "AMD64"):
        lacking = [f"x86-64 (this is {platform.machine()})"]
    if lacking:
        raise ConfigError(f"STRATA_KERNEL_MARCH={march}: this CPU cannot run it (lacks {', '.join(lacking)})")
    return [flag if not flag.startswith("-march=") else f"-march={march}" for flag in _FLAGS]


def _build(name: str, compiler: str) -> Path:
    source = SOURCES / f"{name}.c"
    # Every header counts, each with its name: a header's move or rename is a new build too.
    headers = [h.name.encode() + b"\0" + h.read_bytes() for h in sorted(SOURCES.glob("*.h"))]
    flags = compiler_flags()
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join([compiler, *flags]).encode(),
                                     platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several worker processes may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


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
    """The library built from csrc/<name>.c, checked against abi.py (KernelAbiError where it disagrees), or None
    (with a warning) when it cannot be built here."""
    import torch  # noqa: F401 - torch's OpenMP runtime must be loaded first, so the library shares it

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: %s runs its slower plain-torch path", name)
        return None
    try:
        lib = ctypes.CDLL(str(_build(name, compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not build %s, its slower plain-torch path runs instead: %s", name,
                       getattr(e, "stderr", "") or e)
        return None
    abi.check(name, lib)
    return lib

"""The weight-only and GEMM libraries built with forced instruction sets, so that a machine of any kind checks every
build it can run (the plain-C fallback, AVX2/FMA with AVX-512 off, the same with AVX-VNNI, AVX-512 without VNNI,
with it, with AMX tiles and with their int8 products), beside the native build the other tests use; and the GEMM's
engine (FMA or AMX) forced for a block."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.kernels.cpu import abi
from strata.kernels.cpu import build as cpu_build
from strata.kernels.cpu import matmul as cpu_matmul

_AVX512 = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw"]
# name -> (compiler flags, the CPU flags the build needs to run)
BUILDS = {"portable": (["-DSTRATA_PORTABLE"], set()),
          "avx2": (["-mavx2", "-mfma", "-DSTRATA_NO_AVX512"], {"avx2", "fma"}),
          "avx2_vnni": (["-mavx2", "-mfma", "-mavxvnni", "-DSTRATA_NO_AVX512"], {"avx2", "fma", "avx_vnni"}),
          "avx512": (_AVX512, {"avx2", "fma", "avx512f", "avx512bw"}),
          "avx512_vnni": ([*_AVX512, "-mavx512vnni"], {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}),
          "amx": ([*_AVX512, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
                  {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}),
          "amx_int8": ([*_AVX512, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
                       {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                        "amx_int8"})}
# Every weight kind the GEMM reads: bfloat16, int4, int8, FP8, then GGUF's (32 + ggml's type).
GEMM_KINDS = (1, 4, 8, 9, *(32 + t for t in (1, 2, 3, 6, 7, 8, 12, 13, 14, 30)))


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


_LIBRARIES = ("weight_only", "weight_gemm")
# (build, optimization) -> the folder its libraries were compiled into, once a session: compiling the AVX-512 builds
# takes seconds a library, and five test modules ask for every build.
_compiled: dict[tuple[str, str], Path] = {}


def _compile(build: str, opt: str, compiler: str) -> Path:
    if (build, opt) not in _compiled:
        folder = Path(tempfile.mkdtemp(prefix=f"strata-{build}{opt}-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        jobs = [subprocess.Popen([compiler, opt, "-fopenmp", "-shared", "-fPIC", *BUILDS[build][0],
                                  str(cpu_build.SOURCES / f"{name}.c"), "-o", str(folder / f"{name}.so"), "-lm"])
                for name in _LIBRARIES]
        for job in jobs:
            if job.wait():
                raise subprocess.CalledProcessError(job.returncode, job.args)
        _compiled[build, opt] = folder
    return _compiled[build, opt]


@contextlib.contextmanager
def forced_build(build: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opt: str = "-O1") -> Iterator[None]:
    """cpu_matmul's products run on `build` inside the block (skipped where no compiler or the CPU cannot run it)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    needs = BUILDS[build][1]
    if needs - cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_flags())}")
    compiled = _compile(build, opt, compiler)
    libraries = {}
    for name in _LIBRARIES:
        # A copy of its own: loaded anew, so that its globals (crossovers, engines) start from their defaults.
        target = tmp_path / f"{name}_{build}.so"
        if not target.exists():  # (never written over: a loaded library's file must not change under it)
            shutil.copyfile(compiled / f"{name}.so", target)
        libraries[name] = ctypes.CDLL(str(target))
        abi.check(name, libraries[name])  # each forced build lays out and numbers its kinds as abi.py does
    monkeypatch.setattr(cpu_build, "load", libraries.__getitem__)
    cpu_matmul.weight_only_library.cache_clear()
    cpu_matmul.gemm_library.cache_clear()
    try:
        yield
    finally:
        cpu_matmul.weight_only_library.cache_clear()
        cpu_matmul.gemm_library.cache_clear()


@contextlib.contextmanager
def gemm_engine(engine: str) -> Iterator[None]:
    """cpu_matmul's large-batch products on `engine` ("FMA", or "AMX" for every kind that has it) inside the block;
    skipped where the library has no AMX path or the operating system refuses this process AMX's tiles."""
    lib = cpu_matmul.gemm_library()
    if lib is None:
        pytest.skip("no C compiler")
    kinds = [k for k in GEMM_KINDS if lib.gemm_engine(k) >= 0]
    if engine == "AMX" and not kinds:
        pytest.skip("this build of the GEMM has no AMX path (the CPU lacks AMX-BF16)")
    before = {k: lib.gemm_engine(k) for k in kinds}
    try:
        for k in kinds:
            if lib.set_gemm_engine(k, 1 if engine == "AMX" else 0) == -1:
                pytest.skip("the operating system refuses this process AMX's tile state")
        yield
    finally:
        for k, e in before.items():
            lib.set_gemm_engine(k, e)

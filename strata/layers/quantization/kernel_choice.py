"""Kernel choices measured on the machine that runs them, not tuned on one: for each GGUF block type, up to how many
rows of x the fixed-point kernels (x rounded to 24-bit integers, one pass a row) beat the float ones (each run
widened once for all rows). A short calibration on the first weight of a type, cached per build and CPU."""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path

import torch

from strata import native
from strata.layers.quantization import cpu_matmul, gguf_quants

logger = logging.getLogger(__name__)

MAX_ROWS = 4  # rows timed: past a few rows one pass a row loses on every CPU measured
_WEIGHT_BYTES = 64 << 20  # more than most last-level caches: the rows come from memory, as a model's do
_REPEATS = 5


def _cache_file() -> Path:
    """The calibrations of this build of the kernels (its name hashes the sources, compiler flags and CPU flags)."""
    library = getattr(cpu_matmul._library(), "_name", "weight_only")
    return native.cache_dir() / f"{Path(library).stem}-choices.json"


def _read_cache() -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads(_cache_file().read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_cache(key: str, rows: int) -> None:
    path = _cache_file()
    entries = _read_cache() | {key: rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # workers may calibrate at once: each renames its own file
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _product_seconds(weight: torch.Tensor, kind: int, k: int, rows: int) -> float:
    x = torch.randn(rows, k)
    cpu_matmul.matmul(x, weight, kind, weight.shape[0])
    best = float("inf")
    for _ in range(_REPEATS):
        started = time.perf_counter()
        cpu_matmul.matmul(x, weight, kind, weight.shape[0])
        best = min(best, time.perf_counter() - started)
    return best


def measure_fixed_point_rows(kind: int, values_per_block: int, bytes_per_block: int) -> int:
    """Times both kernels at 1..MAX_ROWS rows on a [N, 4096] weight of this kind and returns the most rows up to
    which the fixed-point one is faster at every count. The weight's bytes are all 0x11: valid blocks of normal
    scales (their arithmetic costs what any weight's does) that the zero page cannot stand in for."""
    k = 4096
    row_bytes = k // values_per_block * bytes_per_block
    weight = torch.full((_WEIGHT_BYTES // row_bytes, row_bytes), 0x11, dtype=torch.uint8)
    lib = cpu_matmul._library()
    times = {}
    try:
        for fixed in (True, False):
            lib.set_fixed_point_rows(kind, MAX_ROWS if fixed else 0)
            times[fixed] = [_product_seconds(weight, kind, k, m) for m in range(1, MAX_ROWS + 1)]
    finally:
        lib.set_fixed_point_rows(kind, 0)
    chosen = 0
    while chosen < MAX_ROWS and times[True][chosen] < times[False][chosen]:
        chosen += 1
    pairs = ", ".join(f"{1e6 * a:.0f}/{1e6 * b:.0f}" for a, b in zip(times[True], times[False], strict=True))
    logger.info("kernel choice for GGUF kind %d: fixed point up to %d rows (us fixed / float at 1..%d rows: %s)", kind,
                chosen, MAX_ROWS, pairs)
    return chosen


@functools.cache
def fixed_point_rows(qtype: int) -> int | None:
    """Sets, once a process, up to how many rows of x a GGUF type's products take the fixed-point kernels: the
    cached calibration of this build, else a new one (about a second). None where this build has none for it."""
    if not cpu_matmul.available():
        return None
    lib = cpu_matmul._library()
    kind = gguf_quants.kernel_kind(qtype)
    if lib.fixed_point_rows(kind) < 0:
        return None  # no such kernel here (a portable build, or a kind it does not serve)
    key = gguf_quants.type_name(qtype)
    rows = _read_cache().get(key)
    if rows is None or not 0 <= rows <= MAX_ROWS:  # none yet, or a cache file edited out of range
        t = gguf_quants.TYPES[qtype]
        rows = measure_fixed_point_rows(kind, t.values_per_block, t.bytes_per_block)
        _write_cache(key, rows)
    lib.set_fixed_point_rows(kind, rows)
    return rows


def summary(qtypes: set[int]) -> str:
    """The choices in force for a model's GGUF types, for `strata bench latency` (empty when it has none)."""
    if not qtypes or not cpu_matmul.available():
        return ""
    lib = cpu_matmul._library()
    rows = {t: lib.fixed_point_rows(gguf_quants.kernel_kind(t)) for t in sorted(qtypes) if t in gguf_quants.TYPES}
    parts = [f"{gguf_quants.type_name(t)} up to {r} rows" for t, r in rows.items() if r >= 0]
    return "GGUF fixed-point kernels (then float): " + ", ".join(parts) if parts else ""

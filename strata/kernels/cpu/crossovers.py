"""Every crossover of the CPU kernels (the batch sizes where one kernel starts to beat another) and their calibration.

Fixed ones are the constants below. The others are measured on the machine that runs them, not tuned on one (and set
into the C libraries' globals before a weight's first product): for each GGUF block type, up to how many
rows of x the fixed-point kernels (x rounded to 24-bit integers, one pass a row) beat the float ones (each run
widened once for all rows); for each kind of narrow weight, whether the large-batch products run on AMX tiles or
the FMA GEMM, and up to how many rows the small-batch kernels beat that GEMM. A short calibration on the
first weight of a kind, cached per build and CPU; figures that do not repeat (a busy machine) are never cached.
STRATA_RECALIBRATE=1 (or `strata bench kernels --recalibrate`) measures again."""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from strata.gguf.types import F32 as GGUF_F32
from strata.gguf.types import TYPES, check_type, type_name
from strata.kernels.cpu import abi, build
from strata.kernels.cpu import matmul as cpu_matmul

logger = logging.getLogger(__name__)

# Rows up to which the small-batch kernel beats oneDNN's GEMM on oneDNN-packed float32 / bfloat16 weights (2 Zen 4
# cores).
SMALL_BATCH_DENSE = 3
# Rows up to which the small-batch kernel beats the GEMM on a plain bfloat16 weight (2 Zen 3 cores, [1024 -> 5632]:
# 2.3 against 3.4 ms at 8 rows, even at 16, 6.8 against 5.7 at 24).
SMALL_BATCH_PLAIN = 16
# Rows up to which the small-batch kernel beats the GEMM on an int4 / int8 / FP8 weight (2 Zen 3 cores, [1024 -> 5632]
# int4: 2.3 against 3.5 ms at 8 rows, even at 16, 6.6 against 5.3 at 24): the most `small_batch_rows` measures.
SMALL_BATCH_WEIGHT_ONLY = 16
# ... on GGUF blocks (each weight row read once for all of x, dequantized once per 8 rows). Two Xeon (AVX-512) threads,
# [1536 x 768], microseconds small against GEMM: at 16 rows Q4_1 261 / 325, Q8_0 245 / 293, Q6_K 343 / 370, Q4_K
# 399 / 325; at 24 rows even (404 / 387 ... 520 / 433).
SMALL_BATCH_GGUF = 16
# ... on MXFP4 blocks (each weight row read once per 4 rows of x); more rows dequantize panels and run the GEMM.
SMALL_BATCH_MXFP4 = 16

MAX_ROWS = 4  # rows timed: past a few rows one pass a row loses on every CPU measured
_WEIGHT_BYTES = 64 << 20  # more than most last-level caches: the rows come from memory, as a model's do
_REPEATS = 5
# Two timings of the same products agree when every figure is within 10% of the other's: on an idle core best-of-5
# figures repeat within a few percent, while another process on the core inflates some figures by a time slice
# (a calibration taken so would steer every later load); three timings without two in a row agreeing keep the
# defaults, uncached, to measure again on the next load.
_TOLERANCE, _ATTEMPTS = 0.10, 3
_clock = time.perf_counter  # a test's fake timer goes here
_measured: set[str] = set()  # keys measured by this process: under STRATA_RECALIBRATE, the only cache entries read
_announced = False
_busy = False  # a calibration of this process found the machine busy: the rest keep their defaults, untimed


class MachineBusy(Exception):
    """The timings of a calibration did not repeat: the choice keeps its default and nothing is cached."""


def machine_was_busy() -> bool:
    """Whether a calibration of this process found timings that did not repeat (its choices kept their defaults)."""
    return _busy


def recalibrating() -> bool:
    return os.environ.get("STRATA_RECALIBRATE", "") not in ("", "0")


def _announce() -> None:
    """One line before this process's first measurement, saying what the pause is."""
    global _announced
    if not _announced:
        _announced = True
        logger.info("measuring this CPU's kernel crossovers once for this build (~20 s on a first load, then cached "
                    "in %s; STRATA_RECALIBRATE=1 or `strata bench kernels --recalibrate` measures again)",
                    cache_file())


def _settled(time_once: Callable[[], list[float]], what: str) -> list[float]:
    """The figures of `time_once`, taken until two timings in a row agree within _TOLERANCE (the lower of each
    pair), at most _ATTEMPTS times; MachineBusy where they never do, and from then on in this process without
    timing anything (each would cost its _ATTEMPTS timings to learn the same; the next load measures again)."""
    global _busy
    if _busy:
        raise MachineBusy(what)
    _announce()
    previous, spread = time_once(), 0.0
    for _ in range(_ATTEMPTS - 1):
        current = time_once()
        spread = max(abs(a - b) / max(min(a, b), 1e-12) for a, b in zip(previous, current, strict=True))
        if spread <= _TOLERANCE:
            return [min(a, b) for a, b in zip(previous, current, strict=True)]
        previous = current
    logger.warning("kernel timings for %s differ by up to %.0f%% from one run to the next (a busy machine?): this "
                   "process keeps the default choices, uncached, to be measured on the next load", what, 100 * spread)
    _busy = True
    raise MachineBusy(what)


def cache_file() -> Path:
    """The calibrations of this build of the kernels (its name hashes the sources, compiler flags and CPU flags)."""
    library = getattr(cpu_matmul.weight_only_library(), "_name", "weight_only")
    return build.cache_dir() / f"{Path(library).stem}-choices.json"


def forget() -> None:
    """Drops this build's cached choices, and what this process chose, so that every choice is measured again."""
    global _busy
    cache_file().unlink(missing_ok=True)
    _measured.clear()
    _busy = False
    fixed_point_rows.cache_clear()
    gemm_engine.cache_clear()


def _cached(key: str) -> int | None:
    """The cached choice for `key`; under STRATA_RECALIBRATE only one this process measured."""
    if recalibrating() and key not in _measured:
        return None
    return _read_cache().get(key)


def _read_cache() -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads(cache_file().read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_cache(key: str, rows: int) -> None:
    _measured.add(key)
    path = cache_file()
    entries = _read_cache() | {key: rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # workers may calibrate at once: each renames its own file
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _best_seconds(product) -> float:
    """The best of _REPEATS timed calls, after one untimed."""
    product()
    best = float("inf")
    for _ in range(_REPEATS):
        started = _clock()
        product()
        best = min(best, _clock() - started)
    return best


def _product_seconds(weight: torch.Tensor, kind: int, k: int, rows: int) -> float:
    x = torch.randn(rows, k)
    return _best_seconds(lambda: cpu_matmul.matmul(x, weight, kind, weight.shape[0]))


def measure_fixed_point_rows(kind: int, values_per_block: int, bytes_per_block: int) -> int:
    """Times both kernels at 1..MAX_ROWS rows on a [N, 4096] weight of this kind and returns the most rows up to
    which the fixed-point one is faster at every count (MachineBusy where the timings do not repeat). The weight's
    bytes are all 0x11: valid blocks of normal scales (their arithmetic costs what any weight's does) that the zero
    page cannot stand in for."""
    k = 4096
    row_bytes = k // values_per_block * bytes_per_block
    weight = torch.full((_WEIGHT_BYTES // row_bytes, row_bytes), 0x11, dtype=torch.uint8)
    lib = cpu_matmul.weight_only_library()
    before = lib.fixed_point_rows(kind)

    def time_once() -> list[float]:
        figures = []
        for fixed in (True, False):
            lib.set_fixed_point_rows(kind, MAX_ROWS if fixed else 0)
            figures += [_product_seconds(weight, kind, k, m) for m in range(1, MAX_ROWS + 1)]
        return figures

    try:
        figures = _settled(time_once, f"GGUF kind {kind}")
    finally:
        lib.set_fixed_point_rows(kind, before)
    times = {True: figures[:MAX_ROWS], False: figures[MAX_ROWS:]}
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
    lib = cpu_matmul.weight_only_library()
    check_type(qtype, "weight")
    kind = abi.KIND_GGUF + qtype
    if lib.fixed_point_rows(kind) < 0:
        return None  # no such kernel here (a portable build, or a kind it does not serve)
    key = type_name(qtype)
    rows = _cached(key)
    if rows is None or not 0 <= rows <= MAX_ROWS:  # none yet, or a cache file edited out of range
        t = TYPES[qtype]
        try:
            rows = measure_fixed_point_rows(kind, t.values_per_block, t.bytes_per_block)
        except MachineBusy:
            return lib.fixed_point_rows(kind)  # the build's default
        _write_cache(key, rows)
    lib.set_fixed_point_rows(kind, rows)
    return rows


GEMM_ROWS, GEMM_K, GEMM_N = 128, 2048, 1024  # a prefill chunk through a mid-sized linear layer: about 0.5 GFLOP
GEMM_ENGINES = ("FMA", "AMX")  # by their numbers: abi.GEMM_FMA, abi.GEMM_AMX
_DENSE_NAMES = {abi.KIND_BF16: "bfloat16", abi.KIND_INT4: "int4", abi.KIND_INT8: "int8",
                abi.KIND_FP8: "fp8"}


def kind_name(kind: int) -> str:
    """A kernel kind as users know it: the GGUF type's name, or bfloat16 / int4 / int8 / fp8."""
    if kind >= abi.KIND_GGUF:
        return type_name(kind - abi.KIND_GGUF)
    return _DENSE_NAMES.get(kind, f"kind {kind}")


def _gemm_row_bytes(kind: int) -> int:
    """Bytes of one row of GEMM_K values of this kind."""
    if kind >= abi.KIND_GGUF:
        t = TYPES[kind - abi.KIND_GGUF]
        return GEMM_K // t.values_per_block * t.bytes_per_block
    return {abi.KIND_BF16: 2 * GEMM_K, abi.KIND_INT4: GEMM_K // 2}.get(kind, GEMM_K)  # int8, FP8: 1


def _gemm_operands(kind: int) -> dict:
    """A [GEMM_N, GEMM_K] weight of this kind for the products, its bytes all 0x11 (valid blocks, normal scales)."""
    weight = torch.full((GEMM_N, _gemm_row_bytes(kind)), 0x11, dtype=torch.uint8)
    if kind >= abi.KIND_GGUF:
        return {"weight": weight}
    if kind == abi.KIND_BF16:
        return {"weight": weight.view(torch.bfloat16)}
    per_group = 128 if kind == abi.KIND_INT4 else GEMM_K  # W4A16's usual groups, W8A16 / FP8 per channel
    return {"weight": weight, "scales": torch.ones(GEMM_N, GEMM_K // per_group), "group_size": per_group}


def measure_gemm_engine(kind: int) -> str | None:
    """Times the FMA GEMM and the AMX one on GEMM_ROWS rows of x and returns the faster; None where the operating
    system refuses this process AMX's tile state (MachineBusy where the timings do not repeat)."""
    lib, operands = cpu_matmul.gemm_library(), _gemm_operands(kind)
    x = torch.randn(GEMM_ROWS, GEMM_K)
    if lib.set_gemm_engine(kind, abi.GEMM_AMX) != 0:
        return None

    def time_once() -> list[float]:
        figures = []
        for number in range(len(GEMM_ENGINES)):
            lib.set_gemm_engine(kind, number)
            figures.append(_best_seconds(lambda: cpu_matmul.narrow_gemm(x, out_features=GEMM_N, kind=kind,
                                                                        **operands)))
        return figures

    try:
        times = dict(zip(GEMM_ENGINES, _settled(time_once, f"the {kind_name(kind)} GEMM"), strict=True))
    finally:
        lib.set_gemm_engine(kind, abi.GEMM_FMA)
    chosen = min(times, key=times.get)
    logger.info("kernel choice for %s: %s GEMM for large batches (us FMA / AMX at %d rows: %.0f/%.0f)",
                kind_name(kind), chosen, GEMM_ROWS, 1e6 * times["FMA"], 1e6 * times["AMX"])
    return chosen


@functools.cache
def gemm_engine(kind: int) -> str | None:
    """Sets, once a process, which engine a weight kind's large-batch products take ("FMA" or "AMX"): the cached
    calibration of this build, else a new one (tens of milliseconds). None where this build has no AMX path for the
    kind (the FMA GEMM serves it, unmeasured)."""
    if not cpu_matmul.available():
        return None
    lib = cpu_matmul.gemm_library()
    if lib.gemm_engine(kind) < 0:
        return None
    key = f"gemm {kind_name(kind)}"
    cached = _cached(key)
    try:
        engine = GEMM_ENGINES[cached] if cached in (0, 1) else measure_gemm_engine(kind)
    except MachineBusy:
        return "FMA"  # the build's default, left set by the measurement
    if engine is not None and cached is None:
        _write_cache(key, GEMM_ENGINES.index(engine))
    if engine is None or lib.set_gemm_engine(kind, GEMM_ENGINES.index(engine)) != 0:
        # a refusal belongs to this process (its signal stacks, its kernel), so it is not cached
        logger.warning("the operating system refuses this process AMX tiles: %s products keep the FMA GEMM",
                       kind_name(kind))
        lib.set_gemm_engine(kind, abi.GEMM_FMA)
        return "FMA"
    return engine


# Rows timed against the GEMM: every count from 8 to 12, where a verification step of 8 drafts (9 rows) falls.
_CROSSOVER_ROWS = (8, 9, 10, 11, 12, 14, 16)
_COPIES_BYTES, _MOST_COPIES = 32 << 20, 64  # what a crossover timing cycles through: far more than L2 holds


def _weight_copies(operands: dict) -> list[dict]:
    """The operands with copies of the weight, up to _COPIES_BYTES in all: a product timed on one weight again and
    again reads it from the core's caches, where a model's layers read theirs from memory. The GEMM pays more for
    that (SmolLM2's Q4_1 [3072 x 576] at 9 rows on two Xeon cores, small-batch kernel / AMX GEMM: 187 / 183 us on
    one weight, 209 / 246 on 60 copies)."""
    weight = operands["weight"]
    count = max(1, min(_MOST_COPIES, _COPIES_BYTES // max(1, weight.nbytes)))
    return [operands] + [{**operands, "weight": weight.clone()} for _ in range(count - 1)]


def measure_small_batch_rows(operands: dict, k: int) -> int:
    """Times the small-batch kernel and the GEMM at _CROSSOVER_ROWS rows of x [rows, k] on one weight (cpu_matmul's
    keywords), each call a pass over copies of it, and returns the most rows up to which the small-batch kernel is
    faster at every count timed (7 when it loses at 8: fewer rows are not timed, the kernel reads each weight row
    once for all of them). MachineBusy where the timings do not repeat."""
    copies, inputs = _weight_copies(operands), [torch.randn(rows, k) for rows in _CROSSOVER_ROWS]

    def time_once() -> list[float]:
        return [_best_seconds(lambda product=product, x=x: [product(x, **c) for c in copies])
                for x in inputs for product in (cpu_matmul.matmul, cpu_matmul.narrow_gemm)]

    figures = _settled(time_once, f"{kind_name(operands['kind'])} [{operands['out_features']} x {k}]")
    times = list(zip(figures[::2], figures[1::2], strict=True))
    chosen = _CROSSOVER_ROWS[0] - 1
    for rows, (small, gemm) in zip(_CROSSOVER_ROWS, times, strict=True):
        if small >= gemm:
            break
        chosen = rows
    logger.info("kernel choice for %s [%d x %d]: small-batch kernel up to %d rows, then the GEMM (us small / GEMM "
                "a product at %s rows, timed on %s: %s)", kind_name(operands["kind"]), operands["out_features"], k,
                chosen, "/".join(map(str, _CROSSOVER_ROWS)),
                f"{len(copies)} copies of the weight" if len(copies) > 1 else "the weight alone",
                ", ".join(f"{1e6 * a / len(copies):.0f}/{1e6 * b / len(copies):.0f}" for a, b in times))
    return chosen


def small_batch_rows(operands: dict, k: int) -> int:
    """Up to how many rows of x products with this weight (cpu_matmul's keywords, K = k) take the small-batch
    kernel, more rows the GEMM. Measured on the weight itself against the GEMM its kind takes here (AMX tiles or
    FMA), cached per kind, shape and engine: the GEMM's fixed cost a call (widening the weight, or setting up tiles)
    against the kernel's cost a row moves the crossover with the machine and the layer's size (int4 [2816 x 1024]
    on two Xeon cores built for AVX2: the FMA GEMM wins from 12 rows; Zen 3 measured 16). Float32 GGUF weights,
    whose large batches are oneDNN's, keep SMALL_BATCH_GGUF."""
    kind = operands["kind"]
    most = SMALL_BATCH_GGUF if kind >= abi.KIND_GGUF else SMALL_BATCH_WEIGHT_ONLY
    if kind == abi.KIND_GGUF + GGUF_F32:
        return most
    engine = gemm_engine(kind) or "FMA"
    key = f"small-batch {kind_name(kind)} {operands['out_features']}x{k} {engine}"
    rows = _cached(key)
    if rows is None or not 1 <= rows <= most:
        try:
            rows = measure_small_batch_rows(operands, k)
        except MachineBusy:
            return most
        _write_cache(key, rows)
    return rows


def choose(operands: dict, k: int) -> int:
    """Every measured choice for a weight a model holds (cpu_matmul's keywords, K = k), made (or read back) before
    its first step; returns the rows up to which its products take the small-batch kernel."""
    kind = operands["kind"]
    if kind >= abi.KIND_GGUF:
        fixed_point_rows(kind - abi.KIND_GGUF)
    gemm_engine(kind)
    return small_batch_rows(operands, k)


def summary(kinds: dict[int, set[int]]) -> str:
    """The choices in force for a model's weight kinds (each with the small-batch rows its layers were given), for
    `strata bench latency` (empty when it has none)."""
    if not kinds or not cpu_matmul.available():
        return ""
    lib, gemm = cpu_matmul.weight_only_library(), cpu_matmul.gemm_library()
    rows = {k: lib.fixed_point_rows(k) for k in sorted(kinds) if k >= abi.KIND_GGUF}
    parts = []
    fixed = [f"{kind_name(k)} up to {r} rows" for k, r in rows.items() if r >= 0]
    if fixed:
        parts.append("GGUF fixed-point kernels (then float): " + ", ".join(fixed))
    engines = [f"{kind_name(k)} {'AMX' if gemm.gemm_engine(k) == abi.GEMM_AMX else 'FMA'} above "
               f"{'/'.join(map(str, sorted(kinds[k])))} rows" for k in sorted(kinds)
               if k not in (abi.KIND_F32, abi.KIND_GGUF_F32)]  # float32 weights: oneDNN's
    return "; ".join([*parts, "large-batch GEMM: " + ", ".join(engines)])

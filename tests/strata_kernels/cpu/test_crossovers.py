"""The measured kernel choices: the GGUF fixed-point / float crossover and each kind's large-batch GEMM engine are
timed once per build and CPU, cached, read back instead of re-timed, and products stay exact whichever kernel they
pick."""
from __future__ import annotations

import json
import logging

import gguf_packing as gp
import pytest
import torch

from strata.kernels.cpu import abi, crossovers
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.quantization import gguf_quants

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no C compiler")


@pytest.fixture(autouse=True)
def machine_found_quiet(monkeypatch):
    """Each test starts as a new process does: an earlier test's load on a busy machine must not carry over."""
    monkeypatch.setattr(crossovers, "_busy", False)


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """An empty kernel cache, a small calibration weight, and each kind's crossover put back afterwards."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(crossovers, "_WEIGHT_BYTES", 1 << 20)
    # Real timings on a shared test machine need not repeat: the busy-machine rule has tests of its own (fake timer).
    monkeypatch.setattr(crossovers, "_TOLERANCE", float("inf"))
    monkeypatch.setattr(crossovers, "_busy", False)
    monkeypatch.setattr(crossovers, "_measured", set())
    monkeypatch.delenv("STRATA_RECALIBRATE", raising=False)
    lib = cpu_matmul.weight_only_library()
    kinds = [gguf_quants.kernel_kind(t) for t in (gp.Q4_0, gp.Q4_1, gp.Q4_K, gp.Q6_K)]
    before = {kind: lib.fixed_point_rows(kind) for kind in kinds}
    gemm = cpu_matmul.gemm_library()
    engines = {kind: gemm.gemm_engine(kind) for kind in (*kinds, abi.KIND_INT4)}
    for kind in engines:
        gemm.set_gemm_engine(kind, 0)  # as a new process starts
    cached = (crossovers.fixed_point_rows, crossovers.gemm_engine)  # a test may patch them over
    for function in cached:
        function.cache_clear()
    yield lib
    for function in cached:
        function.cache_clear()
    for kind, rows in before.items():
        lib.set_fixed_point_rows(kind, rows)
    for kind, engine in engines.items():
        gemm.set_gemm_engine(kind, max(engine, 0))


def test_crossover_is_measured_once_then_read_from_the_cache(fresh_choice, monkeypatch):
    if fresh_choice.fixed_point_rows(gguf_quants.kernel_kind(gp.Q4_K)) < 0:
        pytest.skip("this build has no fixed-point kernels")
    timed = []
    measure = crossovers.measure_fixed_point_rows
    monkeypatch.setattr(crossovers, "measure_fixed_point_rows", lambda *a: timed.append(a) or measure(*a))
    rows = crossovers.fixed_point_rows(gp.Q4_K)
    assert 0 <= rows <= crossovers.MAX_ROWS and len(timed) == 1
    assert fresh_choice.fixed_point_rows(gguf_quants.kernel_kind(gp.Q4_K)) == rows
    [cache] = (crossovers.build.cache_dir()).glob("*-choices.json")
    assert json.loads(cache.read_text()) == {"Q4_K": rows}
    crossovers.fixed_point_rows.cache_clear()  # a new process: the cache answers, nothing is timed
    assert crossovers.fixed_point_rows(gp.Q4_K) == rows and len(timed) == 1
    assert "Q4_K up to" in crossovers.summary({gguf_quants.kernel_kind(gp.Q4_K): {16}})


def test_types_without_fixed_point_kernels_are_not_timed(fresh_choice):
    assert crossovers.fixed_point_rows(gp.Q8_0) is None
    assert crossovers.fixed_point_rows(gguf_quants.F32) is None
    assert not list(crossovers.build.cache_dir().glob("*-choices.json"))


@pytest.mark.parametrize("qtype", (gp.Q4_0, gp.Q4_1, gp.Q4_K, gp.Q6_K), ids=lambda t: gguf_quants.TYPES[t].name)
def test_products_are_exact_whichever_kernel_the_choice_picks(fresh_choice, qtype):
    kind = gguf_quants.kernel_kind(qtype)
    k = 512
    data = gp.random_blocks(qtype, 29, k, seed=3)
    weight = gp.reference(data, qtype)
    for chosen in (0, 8):
        if fresh_choice.set_fixed_point_rows(kind, chosen) == -2:
            pytest.skip("this build has no fixed-point kernels")
        for m in range(1, 10):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) + 2.0
            y = gguf_quants.gguf_linear(x, torch.from_numpy(data), qtype, k)
            expected = torch.from_numpy(x.double().numpy() @ weight.T)
            torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item(),
                                       msg=lambda e, m=m, c=chosen: f"{m} rows, fixed point up to {c}: {e}")


def test_out_of_range_choices_are_refused(fresh_choice):
    kind = gguf_quants.kernel_kind(gp.Q4_1)
    if fresh_choice.set_fixed_point_rows(kind, 2) == -2:
        pytest.skip("this build has no fixed-point kernels")
    assert fresh_choice.set_fixed_point_rows(kind, -1) == -2
    assert fresh_choice.set_fixed_point_rows(kind, 9) == -2
    assert fresh_choice.set_fixed_point_rows(gguf_quants.kernel_kind(gp.Q8_0), 1) == -2
    assert fresh_choice.fixed_point_rows(kind) == 2
    assert fresh_choice.fixed_point_rows(gguf_quants.kernel_kind(gp.Q8_0)) == -2  # no such kernel


def test_gemm_engine_is_measured_once_then_read_from_the_cache(fresh_choice, monkeypatch):
    gemm = cpu_matmul.gemm_library()
    kind = abi.KIND_INT4
    if gemm.gemm_engine(kind) < 0:
        assert crossovers.gemm_engine(kind) is None  # no AMX path in this build: nothing to choose or time
        assert "int4 FMA" in crossovers.summary({kind: {16}})
        return
    if gemm.set_gemm_engine(kind, 1) == -1:
        pytest.skip("the operating system refuses this process AMX's tile state")
    gemm.set_gemm_engine(kind, 0)
    timed = []
    measure = crossovers.measure_gemm_engine
    monkeypatch.setattr(crossovers, "measure_gemm_engine", lambda kind: timed.append(kind) or measure(kind))
    monkeypatch.setattr(crossovers, "GEMM_ROWS", 32)
    engine = crossovers.gemm_engine(kind)
    assert engine in ("FMA", "AMX") and timed == [kind]
    assert crossovers.GEMM_ENGINES[gemm.gemm_engine(kind)] == engine
    [cache] = crossovers.build.cache_dir().glob("*-choices.json")
    assert json.loads(cache.read_text()) == {"gemm int4": crossovers.GEMM_ENGINES.index(engine)}
    crossovers.gemm_engine.cache_clear()  # a new process: the cache answers, nothing is timed
    assert crossovers.gemm_engine(kind) == engine and timed == [kind]
    assert f"large-batch GEMM: int4 {engine}" in crossovers.summary({kind: {9, 12}})


def test_a_process_refused_amx_keeps_the_fma_gemm_and_caches_nothing(fresh_choice, monkeypatch):
    gemm = cpu_matmul.gemm_library()
    kind = abi.KIND_INT4
    if gemm.gemm_engine(kind) < 0:
        pytest.skip("this build has no AMX path")
    monkeypatch.setattr(crossovers, "measure_gemm_engine", lambda kind: None)  # as when arch_prctl says no
    assert crossovers.gemm_engine(kind) == "FMA"
    assert gemm.gemm_engine(kind) == 0
    assert not list(crossovers.build.cache_dir().glob("*-choices.json"))


def test_choose_makes_every_choice_a_kind_has(fresh_choice, monkeypatch):
    made = []
    monkeypatch.setattr(crossovers, "fixed_point_rows", lambda qtype: made.append(("rows", qtype)))
    monkeypatch.setattr(crossovers, "gemm_engine", lambda kind: made.append(("gemm", kind)) or "FMA")
    monkeypatch.setattr(crossovers, "measure_small_batch_rows",
                        lambda operands, k: made.append(("crossover", operands["kind"], k)) or 11)
    q4_1 = {"weight": None, "kind": gguf_quants.kernel_kind(gp.Q4_1), "out_features": 8}
    assert crossovers.choose(q4_1, 64) == 11
    assert crossovers.choose({**q4_1, "kind": abi.KIND_INT8}, 64) == 11
    int8 = abi.KIND_INT8
    assert made == [("rows", gp.Q4_1), ("gemm", q4_1["kind"]), ("gemm", q4_1["kind"]), ("crossover", q4_1["kind"], 64),
                    ("gemm", int8), ("gemm", int8), ("crossover", int8, 64)]
    [cache] = crossovers.build.cache_dir().glob("*-choices.json")
    assert json.loads(cache.read_text()) == {"small-batch Q4_1 8x64 FMA": 11, "small-batch int8 8x64 FMA": 11}


def test_float32_gguf_weights_keep_the_fixed_crossover(fresh_choice, monkeypatch):
    """Their large batches are oneDNN's, not the GEMM the measurement would time."""
    monkeypatch.setattr(crossovers, "measure_small_batch_rows", lambda operands, k: pytest.fail("timed"))
    f32 = {"weight": None, "kind": gguf_quants.kernel_kind(gguf_quants.F32), "out_features": 8}
    assert crossovers.small_batch_rows(f32, 64) == crossovers.SMALL_BATCH_GGUF


def test_small_batch_crossover_is_measured_per_shape_on_the_fma_gemm_then_read_from_the_cache(fresh_choice,
                                                                                             monkeypatch):
    monkeypatch.setattr(crossovers, "gemm_engine", lambda kind: None)  # a build without AMX: the FMA GEMM
    timed = []
    measure = crossovers.measure_small_batch_rows
    monkeypatch.setattr(crossovers, "measure_small_batch_rows",
                        lambda operands, k: timed.append((operands["out_features"], k)) or measure(operands, k))
    weight, scales = torch.randint(0, 256, (96, 128), dtype=torch.uint8), torch.rand(96, 2) + 0.5
    operands = {"weight": weight, "kind": abi.KIND_INT4, "out_features": 96, "scales": scales,
                "group_size": 128}
    rows = crossovers.choose(operands, 256)
    assert 7 <= rows <= crossovers.SMALL_BATCH_WEIGHT_ONLY and timed == [(96, 256)]
    assert crossovers.choose(operands, 256) == rows and timed == [(96, 256)]  # the cache answers
    [cache] = crossovers.build.cache_dir().glob("*-choices.json")
    assert json.loads(cache.read_text()) == {"small-batch int4 96x256 FMA": rows}


def test_small_batch_crossover_is_measured_per_shape_on_amx_then_read_from_the_cache(fresh_choice, monkeypatch):
    kind = gguf_quants.kernel_kind(gp.Q4_0)
    if cpu_matmul.gemm_library().gemm_engine(kind) < 0:
        pytest.skip("this build has no AMX path")
    monkeypatch.setattr(crossovers, "gemm_engine", lambda kind: "AMX")
    timed = []
    measure = crossovers.measure_small_batch_rows
    monkeypatch.setattr(crossovers, "measure_small_batch_rows",
                        lambda operands, k: timed.append((operands["out_features"], k)) or measure(operands, k))
    operands = {"weight": torch.from_numpy(gp.random_blocks(gp.Q4_0, 96, 256)), "kind": kind, "out_features": 96}
    rows = crossovers.choose(operands, 256)
    assert 7 <= rows <= 16 and timed == [(96, 256)]
    assert crossovers.choose(operands, 256) == rows and timed == [(96, 256)]  # the cache answers
    wider = {**operands, "weight": torch.from_numpy(gp.random_blocks(gp.Q4_0, 160, 256)), "out_features": 160}
    crossovers.choose(wider, 256)
    assert timed == [(96, 256), (160, 256)]  # another shape is timed on its own
    [cache] = crossovers.build.cache_dir().glob("*-choices.json")
    assert json.loads(cache.read_text())["small-batch Q4_0 96x256 AMX"] == rows


def test_crossover_timing_reads_copies_of_the_weight_as_a_model_reads_its_weights_from_memory(monkeypatch):
    """Timed again and again on one weight, a product reads it from L2, where the GEMM pays less for it than from
    memory: every timed call passes over distinct copies of the same values, every row count from 8 to 12 timed."""
    weight = torch.randint(0, 256, (64, 512), dtype=torch.uint8)  # 32 KiB: the cap on copies applies
    seen: dict[str, set] = {"small": set(), "gemm": set()}
    rows_timed = []

    def product(name):
        def run(x, weight, **_):
            assert torch.equal(weight, operands["weight"])
            seen[name].add(weight.data_ptr())
            if name == "small":
                rows_timed.append(x.shape[0])
            return torch.zeros(x.shape[0], 64)
        return run

    monkeypatch.setattr(crossovers, "_clock", SteadyClock(1e-3))  # no-op products: their timings would be noise
    monkeypatch.setattr(crossovers.cpu_matmul, "matmul", product("small"))
    monkeypatch.setattr(crossovers.cpu_matmul, "narrow_gemm", product("gemm"))
    operands = {"weight": weight, "kind": abi.KIND_INT8, "out_features": 64}
    crossovers.measure_small_batch_rows(operands, 512)
    assert len(seen["small"]) == len(seen["gemm"]) == crossovers._MOST_COPIES
    assert sorted(set(rows_timed)) == [8, 9, 10, 11, 12, 14, 16]
    third = crossovers._COPIES_BYTES // 3 // 512
    large = {**operands, "weight": torch.zeros(third, 512, dtype=torch.uint8)}
    assert len(crossovers._weight_copies(large)) == 3  # up to _COPIES_BYTES in all
    huge = {**operands, "weight": torch.zeros(3 * third + 1, 512, dtype=torch.uint8)}
    assert len(crossovers._weight_copies(huge)) == 1


class SteadyClock:
    """A fake timer on which every timed call takes `step` seconds."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step / 2  # a timed call reads the clock twice
        return self.now


class FakeMachine:
    """Fake products whose cost moves a fake clock: the small-batch kernel 10 us a row, the GEMM 105 us a call, so
    that they cross after 10 rows. Busy: every call costs 0.4% more than the one before (another process taking
    more and more of the core), so that no two timings repeat."""

    def __init__(self, busy: bool = False) -> None:
        self.now, self.busy, self.calls, self.log_lines_at_first_call = 0.0, busy, 0, None

    def clock(self) -> float:
        return self.now

    def product(self, seconds_per_call):
        def run(x, **_):
            if self.log_lines_at_first_call is None:
                self.log_lines_at_first_call = list(self.caplog.messages) if hasattr(self, "caplog") else []
            self.calls += 1
            self.now += seconds_per_call(x.shape[0]) * (1 + 0.004 * self.calls if self.busy else 1.0)
            return torch.zeros(x.shape[0], 8)
        return run

    def install(self, monkeypatch) -> FakeMachine:
        monkeypatch.setattr(crossovers, "_clock", self.clock)
        monkeypatch.setattr(crossovers, "_TOLERANCE", 0.10)
        monkeypatch.setattr(crossovers.cpu_matmul, "matmul", self.product(lambda rows: 10e-6 * rows))
        monkeypatch.setattr(crossovers.cpu_matmul, "narrow_gemm", self.product(lambda rows: 105e-6))
        monkeypatch.setattr(crossovers, "gemm_engine", lambda kind: "FMA")
        return self


INT8 = {"weight": torch.zeros(8, 64, dtype=torch.uint8), "kind": abi.KIND_INT8, "out_features": 8}
INT8_KEY = "small-batch int8 8x64 FMA"


def _cache() -> dict:
    return json.loads(crossovers.cache_file().read_text())


def test_timings_are_taken_until_two_in_a_row_agree_within_the_tolerance(fresh_choice, monkeypatch):
    monkeypatch.setattr(crossovers, "_TOLERANCE", 0.10)
    runs = iter([[1.0, 1.0], [2.0, 1.0], [2.1, 1.05]])  # the second and third agree (5%), the first is off
    assert crossovers._settled(lambda: next(runs), "test") == [2.0, 1.0]  # the lower of the agreeing pair
    runs = iter([[1.0], [1.2], [1.0], [0.5]])
    with pytest.raises(crossovers.MachineBusy):
        crossovers._settled(lambda: next(runs), "test")
    assert next(runs) == [0.5]  # three timings at most


def test_a_quiet_machine_caches_the_crossover_its_timings_show(fresh_choice, monkeypatch):
    machine = FakeMachine().install(monkeypatch)
    assert crossovers.small_batch_rows(INT8, 64) == 10  # 10 rows cost 100 us < 105; 11 rows 110
    assert _cache() == {INT8_KEY: 10}
    calls = machine.calls
    assert crossovers.small_batch_rows(INT8, 64) == 10 and machine.calls == calls  # the cache answers


def test_a_busy_machine_keeps_the_defaults_caches_nothing_and_times_nothing_more(fresh_choice, monkeypatch, caplog):
    machine = FakeMachine(busy=True).install(monkeypatch)
    assert crossovers.small_batch_rows(INT8, 64) == crossovers.SMALL_BATCH_WEIGHT_ONLY
    assert "differ by up to" in caplog.text and crossovers.machine_was_busy()
    assert not crossovers.cache_file().exists()
    calls = machine.calls
    other = {**INT8, "weight": torch.zeros(16, 64, dtype=torch.uint8), "out_features": 16}
    assert crossovers.small_batch_rows(other, 64) == crossovers.SMALL_BATCH_WEIGHT_ONLY and machine.calls == calls
    monkeypatch.setattr(crossovers, "_busy", False)  # the next load, on an idle machine, measures again
    machine.busy = False
    assert crossovers.small_batch_rows(other, 64) == 10 and _cache() == {"small-batch int8 16x64 FMA": 10}


def test_strata_recalibrate_measures_again_and_replaces_the_cached_choice(fresh_choice, monkeypatch):
    machine = FakeMachine().install(monkeypatch)
    crossovers._write_cache(INT8_KEY, 3)  # figures taken on a busy day, say
    crossovers._measured.clear()  # ... by an earlier process
    assert crossovers.small_batch_rows(INT8, 64) == 3 and machine.calls == 0  # the cache answers
    monkeypatch.setenv("STRATA_RECALIBRATE", "1")
    assert crossovers.small_batch_rows(INT8, 64) == 10 and machine.calls > 0
    assert _cache() == {INT8_KEY: 10}
    calls = machine.calls
    assert crossovers.small_batch_rows(INT8, 64) == 10 and machine.calls == calls  # measured once a process


def test_the_first_measurement_is_announced_at_info_before_it_starts(fresh_choice, monkeypatch, caplog):
    monkeypatch.setattr(crossovers, "_announced", False)
    machine = FakeMachine().install(monkeypatch)
    machine.caplog = caplog
    with caplog.at_level(logging.INFO, logger=crossovers.__name__):
        crossovers.small_batch_rows(INT8, 64)
        crossovers.small_batch_rows({**INT8, "out_features": 16, "weight": torch.zeros(16, 64)}, 64)
    announced = [m for m in caplog.messages if "measuring this CPU's kernel crossovers once" in m]
    assert len(announced) == 1 and "~20 s" in announced[0] and "STRATA_RECALIBRATE=1" in announced[0]
    assert announced[0] in machine.log_lines_at_first_call

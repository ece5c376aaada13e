"""`strata bench kernels` lists this build's cached kernel choices; `--recalibrate` forgets them (stale figures
included) and measures the model-independent ones again (here on fake products and a fake timer: what is tested is
what gets forgotten, measured and cached, not the CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from strata.cli import main
from strata.kernels.cpu import abi, crossovers
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.quantization import gguf_quants

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no C compiler")
GGUF_KINDS = [gguf_quants.kernel_kind(t) for t in sorted(gguf_quants.TYPES)]


@pytest.fixture
def fake_kernels(tmp_path, monkeypatch):
    """An empty cache folder, products taking exactly one tick of a fake timer each, the C library's choices put
    back afterwards."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(crossovers, "_WEIGHT_BYTES", 1 << 16)
    monkeypatch.setattr(crossovers, "_busy", False)
    monkeypatch.setattr(crossovers, "_measured", set())
    clock = iter(range(10 ** 9))
    monkeypatch.setattr(crossovers, "_clock", lambda: next(clock))  # integers: every duration exactly 1
    monkeypatch.setattr(crossovers.cpu_matmul, "matmul", lambda x, weight, *a, **k: torch.zeros(x.shape[0], 1))
    monkeypatch.setattr(crossovers.cpu_matmul, "narrow_gemm", lambda x, **k: torch.zeros(x.shape[0], 1))
    lib, gemm = cpu_matmul.weight_only_library(), cpu_matmul.gemm_library()
    rows = {kind: lib.fixed_point_rows(kind) for kind in GGUF_KINDS}
    kinds = [*GGUF_KINDS, abi.KIND_BF16, abi.KIND_INT4, abi.KIND_INT8, abi.KIND_FP8]
    engines = {kind: gemm.gemm_engine(kind) for kind in kinds}
    crossovers.fixed_point_rows.cache_clear()
    crossovers.gemm_engine.cache_clear()
    yield
    crossovers.fixed_point_rows.cache_clear()
    crossovers.gemm_engine.cache_clear()
    for kind, r in rows.items():
        if r >= 0:
            lib.set_fixed_point_rows(kind, r)
    for kind, engine in engines.items():
        gemm.set_gemm_engine(kind, max(engine, 0))


def test_recalibrate_forgets_stale_choices_and_measures_the_model_independent_ones(fake_kernels, capsys):
    crossovers._write_cache("small-batch Q4_1 576x576 AMX", 3)
    crossovers._write_cache("Q4_K", 4)
    assert main(["bench", "kernels"]) == 0
    assert "small-batch Q4_1 576x576 AMX: small-batch kernel up to 3 rows" in capsys.readouterr().out

    assert main(["bench", "kernels", "--recalibrate"]) == 0
    out = capsys.readouterr().out
    cached = json.loads(crossovers.cache_file().read_text())
    assert "small-batch Q4_1 576x576 AMX" not in cached and "576x576" not in out  # forgotten: shapes need a model
    lib = cpu_matmul.weight_only_library()
    with_fixed_point = {gguf_quants.type_name(t) for t in gguf_quants.TYPES
                        if lib.fixed_point_rows(gguf_quants.kernel_kind(t)) >= 0}
    # Equal fake costs: the fixed-point kernels never win, and neither GEMM engine beats the FMA one.
    assert {k: v for k, v in cached.items() if not k.startswith("gemm ")} == dict.fromkeys(with_fixed_point, 0)
    assert set(cached.values()) <= {0}
    assert all(f"{key}: " in out for key in cached)

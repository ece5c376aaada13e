"""abi.py against the C libraries: every library reports the sizes, offsets and constants it shares with Python and
agrees with abi.py; a Structure or constant that disagrees (a field dropped, reordered or retyped, a number changed,
a library without its table) is refused at load, naming what differs."""
from __future__ import annotations

import ctypes

import pytest

from strata.kernels.cpu import abi, build
from strata.kernels.cpu.abi import F32, KernelAbiError, Shared

LIBRARIES = sorted(path.stem for path in build.SOURCES.glob("*.c"))


def _library(name: str) -> ctypes.CDLL:
    lib = build.load(name)
    if lib is None:
        pytest.skip("no C compiler")
    return lib


@pytest.mark.parametrize("name", LIBRARIES)
def test_every_library_reports_a_table_that_agrees_with_abi_py(name):
    lib = _library(name)
    entries = abi.reported(name, lib)
    shared = abi.SHARED.get(name, Shared())
    assert set(shared.constants) <= set(entries)
    assert {s.c_type for s in shared.structures} <= set(entries)
    assert abi.mismatches(entries, shared) == []
    abi.check(name, lib)


def test_the_decode_structures_are_checked_field_by_field_against_the_compiler():
    entries = abi.reported("decode_layer", _library("decode_layer"))
    for structure in abi.SHARED["decode_layer"].structures:
        fields = [key for key in entries if key.startswith(structure.c_type + ".")]
        assert len(fields) == len(structure._fields_) > 0
        assert entries[structure.c_type][0] == ctypes.sizeof(structure)


def _without(structure: type[ctypes.Structure], dropped: str) -> type[ctypes.Structure]:
    """`structure` with one field left out, under the same C name."""
    return type(structure.__name__, (ctypes.Structure,), {
        "c_type": structure.c_type, "_fields_": [f for f in structure._fields_ if f[0] != dropped]})


def test_a_structure_missing_a_field_is_refused_naming_it():
    lib = _library("decode_layer")
    broken = _without(abi.MlpBlock, "gelu")
    with pytest.raises(KernelAbiError, match=r"MlpBlock \(mlp_block_t\) lacks the C field gelu") as refused:
        abi.check("decode_layer", lib, Shared(structures=(abi.Linear, broken)))
    message = str(refused.value)
    assert "mlp_block_t) field out_norm is at offset" in message  # the fields after it moved
    assert "the C library decode_layer does not match strata/kernels/cpu/abi.py" in message


def test_a_last_field_dropped_is_caught_by_the_size_and_a_retyped_one_by_its_size():
    lib = _library("decode_layer")
    with pytest.raises(KernelAbiError, match=r"Linear \(linear_t\) has size \d+ and alignment 8 in C"):
        abi.check("decode_layer", lib, Shared(structures=(_without(abi.Linear, "gemm_rows"),)))
    retyped = type("Step", (ctypes.Structure,), {"c_type": "decode_step_t", "_fields_": [
        (name, F32 if name == "threads" else kind) for name, kind in abi.Step._fields_]})
    with pytest.raises(KernelAbiError, match=r"field threads is at offset 40 \(size 8\) in C, 40 \(size 4\) here"):
        abi.check("decode_layer", lib, Shared(structures=(retyped,)))


def test_a_wrong_or_unknown_constant_is_refused():
    lib = _library("weight_only")
    with pytest.raises(KernelAbiError, match="KIND_MXFP4 is 16 in C, 17 here"):
        abi.check("weight_only", lib, Shared({"KIND_MXFP4": 17}))
    with pytest.raises(KernelAbiError, match="KIND_NF4 is 5 here and unknown to the C library"):
        abi.check("weight_only", lib, Shared({"KIND_NF4": 5}))
    with pytest.raises(KernelAbiError, match=r"KeyRanges \(key_ranges_t\) is unknown to the C library"):
        abi.check("weight_only", lib, Shared(structures=(abi.KeyRanges,)))


def test_a_library_without_its_table_is_refused():
    with pytest.raises(KernelAbiError, match="has no strata_abi_rms_norm"):
        abi.check("rms_norm", ctypes.CDLL(None))


def test_loading_checks_the_library(monkeypatch):
    _library("shm_collectives")
    monkeypatch.setitem(abi.SHARED, "shm_collectives", Shared({"HEADER_BYTES": 8192}))
    build.load.cache_clear()
    try:
        with pytest.raises(KernelAbiError, match="HEADER_BYTES is 4096 in C, 8192 here"):
            build.load("shm_collectives")
    finally:
        build.load.cache_clear()

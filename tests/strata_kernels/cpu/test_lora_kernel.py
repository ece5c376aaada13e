"""csrc/lora.c against a float64 reference: each row of a decode batch (1 to 16 rows, mixed slots and base rows,
more than 16 rows of one slot) gets base + scale * x A^T B^T of its own adapter's projections (ranks 4, 16, 64; a
fused q/k/v layer's three blocks, each into its own outputs; a projection an adapter leaves alone), on every build
this CPU runs: native, AVX2 with AVX-512 off, and plain C; on one thread and shared among two."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from strata.kernels.cpu import abi
from strata.kernels.cpu import build as cpu_build
from strata.kernels.cpu import lora as cpu_lora
from strata.layers.lora import LinearLoRA, LoRAContext

# name -> (compiler flags, the CPU flags it needs); "native" is the build the engine loads.
BUILDS = {"native": (None, set()), "avx2": (["-mavx2", "-mfma", "-DSTRATA_NO_AVX512"], {"avx2", "fma"}),
          "portable": (["-DSTRATA_PORTABLE"], set())}
SLOTS = 4
# Three projections of a fused layer (q, k, v) side by side: (first output, outputs).
PIECES = [(0, 40), (40, 24), (64, 24)]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


@pytest.fixture(scope="module", params=list(BUILDS))
def lora_apply(request, tmp_path_factory):
    """lora_apply of one build of csrc/lora.c."""
    flags, needs = BUILDS[request.param]
    if flags is None:
        if cpu_lora.library() is None:
            pytest.skip("no C compiler")
        return cpu_lora.library().lora_apply
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or needs - _cpu_flags():
        pytest.skip(f"no C compiler, or this CPU lacks {sorted(needs - _cpu_flags())}")
    target = tmp_path_factory.mktemp("lora") / f"lora_{request.param}.so"
    subprocess.run([compiler, "-O2", "-fopenmp", "-shared", "-fPIC", *flags, str(cpu_build.SOURCES / "lora.c"),
                    "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    abi.check("lora", lib)
    lib.lora_apply.argtypes = [ctypes.POINTER(abi.Lora), abi.PTR, abi.I64, abi.PTR, abi.PTR, abi.I32]
    lib.lora_apply.restype = abi.I32
    return lib.lora_apply


def _adapters(g: torch.Generator, pieces, in_features: int, ranks: list[int], skip=None) -> list:
    """Per slot: (rank, scale, [(A, B) float64, or None where the adapter leaves the projection alone])."""
    return [(rank, 0.5 + slot, [None if (slot, j) == skip else
                                (torch.randn(rank, in_features, generator=g, dtype=torch.float64) / in_features ** 0.5,
                                 torch.randn(size, rank, generator=g, dtype=torch.float64))
                                for j, (_, size) in enumerate(pieces)])
            for slot, rank in enumerate(ranks)]


def _slots(pieces, in_features: int, adapters: list) -> LinearLoRA:
    out = sum(size for _, size in pieces)
    lora = LinearLoRA(SLOTS, 64, len(pieces), in_features, out, LoRAContext(), torch.float32)
    for slot, (rank, scale, pairs) in enumerate(adapters):
        for j, pair in enumerate(pairs):
            if pair is not None:
                lora.set_block(slot, j, rank, pair[0].float(), [(pieces[j][0], pair[1].float())], scale)
    return lora


def _expected(x, base, row_slots, adapters, pieces):
    want = base.double().clone()
    for row, slot in enumerate(row_slots):
        if slot < 0:
            continue
        _, scale, pairs = adapters[slot]
        for pair, (offset, size) in zip(pairs, pieces, strict=True):
            if pair is not None:
                want[row, offset:offset + size] += scale * (x[row].double() @ pair[0].T) @ pair[1].T
    return want


def _run(lora_apply, lora: LinearLoRA, row_slots: list[int], g: torch.Generator, threads: int):
    in_features, out = lora.a.shape[2], lora.bt.shape[2]
    x = torch.randn(len(row_slots), in_features, generator=g)
    base = torch.randn(len(row_slots), out, generator=g)
    y = base.clone()
    view = lora.kernel_view()
    slots = torch.tensor(row_slots, dtype=torch.int64)
    assert lora_apply(ctypes.byref(view), slots.data_ptr(), len(row_slots), x.data_ptr(), y.data_ptr(), threads) == 0
    return x, base, y


@pytest.mark.parametrize("rank", [4, 16, 64])
def test_each_row_adds_its_own_adapters_projections(lora_apply, rank):
    g = torch.Generator().manual_seed(rank)
    adapters = _adapters(g, PIECES, 96, [rank, 4, rank, 16], skip=(1, 1))  # slot 1 leaves k alone
    lora = _slots(PIECES, 96, adapters)
    for rows in (1, 2, 5, 9, 16):
        row_slots = torch.randint(-1, SLOTS, (rows,), generator=g).tolist()
        x, base, y = _run(lora_apply, lora, row_slots, g, threads=1)
        torch.testing.assert_close(y.double(), _expected(x, base, row_slots, adapters, PIECES), rtol=1e-5, atol=1e-4)
        base_rows = [i for i, s in enumerate(row_slots) if s < 0]
        assert torch.equal(y[base_rows], base[base_rows])  # base rows untouched


def test_many_rows_of_one_slot_and_two_threads_agree_with_the_reference(lora_apply):
    """Rows beyond a group of 16 of one slot, and a layer large enough to share its products among threads."""
    g = torch.Generator().manual_seed(7)
    pieces = [(0, 300), (300, 300)]  # a merged gate/up
    adapters = _adapters(g, pieces, 512, [64, 16, 4, 64])
    lora = _slots(pieces, 512, adapters)
    row_slots = [0] * 20 + [-1, 3, 2, 1, 3]
    for threads in (1, 2):
        x, base, y = _run(lora_apply, lora, row_slots, g, threads)
        torch.testing.assert_close(y.double(), _expected(x, base, row_slots, adapters, pieces), rtol=1e-5, atol=1e-4)


def test_cleared_slot_and_row_parallel_layer(lora_apply):
    g = torch.Generator().manual_seed(3)
    pieces = [(0, 33)]  # one projection, an odd width (vector tails)
    adapters = _adapters(g, pieces, 45, [16, 8, 4, 2])
    lora = _slots(pieces, 45, adapters)
    lora.clear_slot(2)
    adapters[2] = (4, 0.0, [None])
    row_slots = [2, 0, -1, 3, 1, 2]
    x, base, y = _run(lora_apply, lora, row_slots, g, threads=1)
    torch.testing.assert_close(y.double(), _expected(x, base, row_slots, adapters, pieces), rtol=1e-5, atol=1e-4)
    assert torch.equal(y[0], base[0]) and torch.equal(y[5], base[5])


def test_binding_refuses_a_slot_past_the_layers():
    if cpu_lora.library() is None:
        pytest.skip("no C compiler")
    lora = LinearLoRA(2, 4, 1, 8, 8, LoRAContext(), torch.float32)
    with pytest.raises(IndexError, match="past the layer's 2"):
        cpu_lora.lora_apply(lora.kernel_view(), torch.tensor([0, 2]), torch.zeros(2, 8), torch.zeros(2, 8))

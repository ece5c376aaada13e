"""Routed experts with x rounded to 8 bits as llama.cpp rounds it (quantized_activations=int8): MXFP4 weights times
Q8_0 x (csrc/mxfp4_q8.h, as ggml_vec_dot_mxfp4_q8_0) and GGUF weights times rows rounded once (q8_round_rows /
q8_rounded_matmul) against a float64 reference of the same rounded x on every build the machine runs; GGUF and
MXFP4 experts against float64 experts fed the same rounded x, each token's row rounded once a step for all its
experts."""
from __future__ import annotations

import contextlib
import functools

import gguf_packing as gp
import numpy as np
import pytest
import test_gguf_experts
import torch
from c_builds import forced_build
from test_gguf_experts import PROJECTIONS, TOP_K, E, H, I, random_blocks, strata_experts
from test_gguf_int8_activations import _round_q8_32, reference

from strata.distributed import ParallelContext
from strata.errors import ConfigError
from strata.kernels.cpu import abi
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.moe import FusedMoE, topk_softmax_routing
from strata.layers.quantization import gguf_quants, mxfp4
from strata.layers.quantization.gguf_experts import gguf_experts
from strata.layers.quantization.rounded_rows import RoundedRows

# The MXFP4 kernel's three forms (AVX-512 VNNI, AVX2's vpmaddubsw, portable C) and the native build; AVX-VNNI's
# build takes AVX2's MXFP4 kernel, and its GGUF kernels are test_gguf_int8_activations'.
BUILDS = ["native", "portable", "avx2", "avx512_vnni"]


def _rounded_x(x: np.ndarray) -> np.ndarray:
    """x [M, K] rounded to Q8_0 as llama.cpp rounds it, as the exact values q * d (float64)."""
    q, d, _ = _round_q8_32(x)
    return q.astype(np.float64) * np.repeat(d, 32, axis=-1)


def _mxfp4_weight(n: int, groups: int, seed: int, exponents=range(110, 140)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, groups, 16), dtype=torch.uint8, generator=g)
    choices = torch.tensor(list(exponents), dtype=torch.uint8)
    return blocks, choices[torch.randint(0, len(choices), (n, groups), generator=g)]


def _check_mxfp4(m: int, groups: int, seed: int, what: str, bias: bool = False, **weight) -> None:
    blocks, scales = _mxfp4_weight(21, groups, seed, **weight)
    x = torch.randn(m, 32 * groups, generator=torch.Generator().manual_seed(seed)) + (2.0 if m % 2 else 0.0)
    b = torch.randn(21, generator=torch.Generator().manual_seed(seed + 1)) if bias else None
    y = mxfp4.mxfp4_linear(x, blocks, scales, b, activations="int8")
    xv, w = _rounded_x(x.numpy()), mxfp4.dequantize(blocks, scales).double().numpy()
    expected, size = xv @ w.T, np.abs(xv) @ np.abs(w).T
    if b is not None:
        expected = expected + b.double().numpy()
    assert y.shape == (m, 21) and y.dtype == torch.float32
    error = np.abs(y.double().numpy() - expected)
    bound = 4e-6 * (size + np.abs(expected)) + 1e-30
    assert (error <= bound).all(), f"{what}: worst error {error.max()} against bound {bound.flat[error.argmax()]}"


def _build(build: str, tmp_path, monkeypatch):
    """cpu_matmul on a forced build, or on the native one the other tests use."""
    if build != "native":
        return forced_build(build, tmp_path, monkeypatch)
    if not cpu_matmul.available():
        pytest.skip("no C compiler")
    return contextlib.nullcontext()


@pytest.mark.parametrize("build", BUILDS)
def test_each_build_equals_float64_of_the_rounded_x(build, tmp_path, monkeypatch):
    """MXFP4 times Q8_0: odd block counts (the VNNI kernel pairs blocks, AVX2 takes two chains), rows past one pass
    of 64, a bias, x with a large mean, extreme exponents (subnormal and huge scales). GGUF weights times rows
    picked by index out of x rounded once (an expert's tokens, repeated and unordered) for every type with int8
    kernels."""
    with _build(build, tmp_path, monkeypatch):
        for groups in (1, 3, 8):
            for m in (1, 2, 5, 70) if groups == 3 else (3,):
                _check_mxfp4(m, groups, seed=m + groups, what=f"{build}, {groups} blocks, {m} rows", bias=m == 5)
        _check_mxfp4(4, 5, seed=9, what=f"{build}, extreme exponents", exponents=(0, 1, 2, 127, 128, 160, 200))
        for qtype in (gp.Q4_0, gp.Q4_1, gp.Q5_0, gp.Q5_1, gp.Q8_0, gp.Q4_K, gp.Q5_K, gp.Q6_K):
            k = 512 if gguf_quants.TYPES[qtype].values_per_block == 256 else 160
            data = gp.random_blocks(qtype, 19, k, qtype)
            x = torch.randn(9, k, generator=torch.Generator().manual_seed(qtype)) + 1.0
            tokens = torch.tensor([7, 0, 3, 3, 8])
            y = RoundedRows(x).product(tokens, torch.from_numpy(data), gguf_quants.kernel_kind(qtype, "int8"),
                                       gguf_quants.TYPES[qtype].values_per_block, 19)
            expected, size = reference(x[tokens].numpy(), data, qtype)
            error = np.abs(y.double().numpy() - expected)
            assert (error <= 4e-6 * (size + np.abs(expected)) + 1e-30).all(), f"{build} {qtype}: {error.max()}"


def _silu_and_mul(v: np.ndarray) -> np.ndarray:
    """FusedMoE's SwiGLU on float32, as the layer computes it between its two products."""
    t = torch.from_numpy(v.astype(np.float32))
    gate, up = t.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).numpy()


def _routed(x: torch.Tensor, logits: torch.Tensor, expert) -> np.ndarray:
    """sum over each token's experts of weight * expert(token's row), in float64 (softmax routing, renormalised)."""
    weights, ids = topk_softmax_routing(logits, TOP_K, renormalize=True)
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            out[t] += float(weights[t, j]) * expert(int(ids[t, j]), x[t:t + 1].numpy())[0]
    return out


def _gguf_reference(blocks: dict[str, np.ndarray], kinds: dict[str, int], x, logits) -> np.ndarray:
    """Each expert from the rounded x in float64: gate and up, SwiGLU in float32, down on its rounded input."""
    def expert(e: int, row: np.ndarray) -> np.ndarray:
        gate_up = np.concatenate([reference(row, blocks[p][e], kinds[p])[0] for p in ("gate_proj", "up_proj")], -1)
        return reference(_silu_and_mul(gate_up), blocks["down_proj"][e], kinds["down_proj"])[0]
    return _routed(x, logits, expert)


def _int8_gguf_experts(blocks, kinds) -> FusedMoE:
    """test_gguf_experts' loading, its experts given int8 activations."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_gguf_experts, "gguf_experts", functools.partial(gguf_experts, activations="int8"))
        return strata_experts(blocks, kinds, ParallelContext())


@pytest.mark.parametrize("kinds", [dict.fromkeys(PROJECTIONS, gp.Q4_0),
                                   {"gate_proj": gp.Q4_K, "up_proj": gp.Q8_0, "down_proj": gp.Q6_K}],
                         ids=["Q4_0", "Q4_K-Q8_0-Q6_K"])
def test_gguf_experts_with_int8_equal_float64_experts_of_the_rounded_x(kinds, monkeypatch):
    """Each token's row rounded once for all its experts' gate/up products (once per block size: Q8_K for Q4_K's
    gate, Q8_0 for Q8_0's up), down rounding its own input: bit for bit the products that round each expert's
    rows themselves; near the float experts."""
    blocks = random_blocks(kinds, seed=4)
    torch.manual_seed(4)
    x, logits = torch.randn(11, H), torch.randn(11, E)
    moe = _int8_gguf_experts(blocks, kinds)
    calls = []
    monkeypatch.setattr(cpu_matmul, "round_rows", lambda rows, per: calls.append((rows.shape[0], per)) or
                        _round_rows(rows, per))
    with torch.no_grad():
        got = moe(x, logits).double().numpy()
    assert sorted(calls) == sorted((11, gguf_quants.TYPES[kinds[p]].values_per_block) for p in
                                   {kinds["gate_proj"]: "gate_proj", kinds["up_proj"]: "up_proj"}.values())
    expected = _gguf_reference(blocks, kinds, x, logits)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() < 1e-4 * scale
    monkeypatch.setattr(moe.quant, "round_inputs", lambda rows: None)  # each expert's product rounds its rows
    with torch.no_grad():
        assert np.array_equal(moe(x, logits).double().numpy(), got)
        exact = strata_experts(blocks, kinds, ParallelContext())(x, logits).double().numpy()
    assert 0 < np.abs(got - exact).max() < 0.05 * scale


_round_rows = cpu_matmul.round_rows


def _mxfp4_moe(activations: str, seed: int) -> FusedMoE:
    """gpt-oss-like experts (biases, softmax after top-k as gpt-oss routes) from random MXFP4 tensors."""
    routing = functools.partial(topk_softmax_routing, renormalize=True)
    moe = FusedMoE(E, TOP_K, H, I, ParallelContext(), torch.float32, apply_router_weight_on_input=False,
                   routing=routing, bias=True)
    mxfp4.mxfp4_experts(moe, "experts", activations)
    g = torch.Generator().manual_seed(seed)
    for proj, (rows, groups) in {"gate_up_proj": (2 * I, H // 32), "down_proj": (H, I // 32)}.items():
        blocks, scales = _mxfp4_weight(E * rows, groups, seed + rows, exponents=range(118, 126))
        getattr(moe, f"{proj}_blocks").data.copy_(blocks.view(E, rows, groups, 16))
        getattr(moe, f"{proj}_scales").data.copy_(scales.view(E, rows, groups))
        getattr(moe, f"{proj}_bias").data.copy_(torch.randn(E, rows, generator=g) * 0.1)
    moe.quant.finish(moe)
    return moe


def test_mxfp4_experts_with_int8_equal_float64_experts_of_the_rounded_x(monkeypatch):
    """gate/up from each token's row rounded once, down from its rounded input; bit for bit the products that round
    each expert's rows themselves; near the float experts."""
    torch.manual_seed(5)
    x, logits = torch.randn(13, H), torch.randn(13, E)
    moe = _mxfp4_moe("int8", seed=5)

    def expert(e: int, row: np.ndarray) -> np.ndarray:
        gu_blocks, gu_scales, d_blocks, d_scales = moe.quant.experts[e]
        gu_bias, d_bias = (b.double().numpy() for b in moe.quant.biases[e])
        gate_up = _rounded_x(row) @ mxfp4.dequantize(gu_blocks, gu_scales).double().numpy().T + gu_bias
        act = moe.activation(torch.from_numpy(gate_up.astype(np.float32))).numpy()
        return _rounded_x(act) @ mxfp4.dequantize(d_blocks, d_scales).double().numpy().T + d_bias

    with torch.no_grad():
        got = moe(x, logits).double().numpy()
        exact = _mxfp4_moe("float", seed=5)(x, logits).double().numpy()
    expected = _routed(x, logits, expert)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() < 1e-4 * scale
    monkeypatch.setattr(moe.quant, "round_inputs", lambda rows: None)
    with torch.no_grad():
        assert np.array_equal(moe(x, logits).double().numpy(), got)
    assert 0 < np.abs(got - exact).max() < 0.05 * scale


def test_rounded_rows_off_the_c_kernels_are_refused(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "available", lambda: False)
    with pytest.raises(ConfigError, match="C kernels only"):
        RoundedRows(torch.ones(2, 32))


def test_kernel_refuses_a_weight_kind_without_int8_kernels():
    rounded = cpu_matmul.round_rows(torch.ones(1, 32), 32)
    with pytest.raises(ValueError, match="do not read weight kind"):
        cpu_matmul.rounded_matmul(rounded, 32, None, torch.zeros(1, 64, dtype=torch.uint8), abi.KIND_GGUF + 1, 1)

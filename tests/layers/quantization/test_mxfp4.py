"""MXFP4 weights (gpt-oss): the torch dequantizer against transformers' own, the C product (every build) against
float64 products of the dequantized weight, and the checkpoint's quantization_config."""
from __future__ import annotations

import pytest
import torch
from c_builds import forced_build
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from strata.config.quant_config import MXFP4QuantConfig, parse_quant_config, quant_tp_problem
from strata.errors import ConfigError
from strata.kernels.cpu import abi
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.quantization import mxfp4

EXTREME_EXPONENTS = (0, 1, 2, 64, 126, 127, 128, 200, 253, 254, 255)


def _random_weight(experts: int, n: int, groups: int, seed: int, exponents=range(118, 135)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, n, groups, 16), dtype=torch.uint8, generator=g)
    choices = torch.tensor(list(exponents), dtype=torch.uint8)
    scales = choices[torch.randint(0, len(choices), (experts, n, groups), generator=g)]
    return blocks, scales


def _transformers(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' dequantization, back in the checkpoint's [E, N, K] orientation (it returns [E, K, N])."""
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)


def test_dequantize_equals_transformers_on_every_byte_and_extreme_exponents():
    every_byte = torch.arange(256, dtype=torch.uint8).view(1, 16, 1, 16).expand(len(EXTREME_EXPONENTS), 16, 1, 16)
    scales = torch.tensor(EXTREME_EXPONENTS, dtype=torch.uint8).view(-1, 1, 1).expand(-1, 16, 1)
    ours, theirs = mxfp4.dequantize(every_byte, scales), _transformers(every_byte, scales, torch.float32)
    assert ours.shape == (len(EXTREME_EXPONENTS), 16, 32) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=False)
    assert torch.equal(ours.signbit(), theirs.signbit())  # -0.0 codes stay negative zeros
    assert ours[0].abs().min() == 0 and ours[0][ours[0] != 0].abs().min() == 2.0 ** -128  # subnormals kept


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_dequantize_equals_transformers_on_random_blocks_and_scales(dtype):
    blocks, scales = _random_weight(3, 7, 5, seed=1, exponents=range(0, 256))
    ours = mxfp4.dequantize(blocks, scales, dtype)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, _transformers(blocks, scales, dtype), rtol=0, atol=0)


def test_malformed_tensors_are_refused():
    with pytest.raises(ConfigError, match="uint8"):
        mxfp4.dequantize(torch.zeros(2, 1, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ConfigError, match=r"\[\.\.\., N, G, 16\]"):
        mxfp4.dequantize(torch.zeros(2, 1, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    blocks, scales = _random_weight(2, 3, 2, seed=0)
    with pytest.raises(ConfigError, match="index the expert first"):
        mxfp4.mxfp4_linear(torch.randn(1, 64), blocks, scales)
    with pytest.raises(ValueError, match="expects 64"):
        mxfp4.mxfp4_linear(torch.randn(1, 32), blocks[0], scales[0])


def _assert_close_to(y: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within 1e-5 of the outputs' scale: float32 accumulation is that exact."""
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=tolerance, msg=lambda e: f"{what}: {e}")


def _on_threads(threads: int, function, *args, **kwargs) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return function(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


def _check_products(what: str) -> None:
    """The C kernel itself for 1..20 rows of x, and mxfp4_linear's routes, on odd shapes, with and without bias."""
    for n, groups, seed in ((37, 3, 1), (1, 1, 2), (19, 5, 3)):
        blocks, scales = _random_weight(1, n, groups, seed)
        blocks, scales = blocks[0], scales[0]
        weight = mxfp4.dequantize(blocks, scales).double()
        bias = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        flat = blocks.reshape(n, groups * 16)
        for m in range(1, 21):
            x = torch.randn(m, groups * 32, generator=torch.Generator().manual_seed(m)) + 1
            expected = x.double() @ weight.T
            threads = 1 + m % 2
            y = _on_threads(threads, cpu_matmul.matmul, x, flat, abi.KIND_MXFP4, n, scales=scales, bias=bias)
            _assert_close_to(y, expected + bias.double(), f"{what}: kernel, {n}x{groups * 32}, {m} rows")
            y = _on_threads(threads, mxfp4.mxfp4_linear, x, blocks, scales)
            assert y.shape == (m, n) and y.dtype == torch.float32
            _assert_close_to(y, expected, f"{what}: mxfp4_linear, {n}x{groups * 32}, {m} rows")


def test_c_product_matches_the_dequantized_weight_for_1_to_20_rows():
    if not cpu_matmul.available():
        pytest.skip("no C compiler")
    _check_products("native build")


@pytest.mark.parametrize("build", ["portable", "avx2", "avx512"])
def test_each_c_build_matches_the_dequantized_weight(build, tmp_path, monkeypatch):
    with forced_build(build, tmp_path, monkeypatch):
        _check_products(build)


def test_one_expert_and_a_row_parallel_shard_multiply_from_their_views():
    """blocks[e] of an [E, N, G, 16] stack, and a shard of whole blocks of each row (not contiguous)."""
    blocks, scales = _random_weight(4, 11, 6, seed=7)
    weight = mxfp4.dequantize(blocks, scales).double()
    x = torch.randn(3, 6 * 32)
    y = mxfp4.mxfp4_linear(x, blocks[2], scales[2])
    _assert_close_to(y, x.double() @ weight[2].T, "expert 2")
    shard_b, shard_s = blocks[1, :, 2:5], scales[1, :, 2:5]
    y = mxfp4.mxfp4_linear(x[:, :96], shard_b, shard_s)
    _assert_close_to(y, x[:, :96].double() @ weight[1, :, 64:160].T, "shard of blocks 2-4")


def test_without_the_kernels_the_dequantized_weight_runs_in_the_inputs_dtype(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "available", lambda: False)
    blocks, scales = _random_weight(1, 9, 2, seed=4)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    bias = torch.randn(9)
    y = mxfp4.mxfp4_linear(x, blocks[0], scales[0], bias)
    assert y.shape == (2, 5, 9) and y.dtype == torch.bfloat16
    expected = x.double() @ mxfp4.dequantize(blocks[0], scales[0]).double().T + bias.to(torch.bfloat16).double()
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_dequantize_on_cuda_equals_transformers():
    blocks, scales = _random_weight(2, 5, 3, seed=3, exponents=range(0, 256))
    ours = mxfp4.dequantize(blocks.cuda(), scales.cuda(), torch.bfloat16)
    assert ours.device.type == "cuda"
    torch.testing.assert_close(ours.cpu(), _transformers(blocks, scales, torch.bfloat16), rtol=0, atol=0)
    x = torch.randn(4, 96, device="cuda", dtype=torch.bfloat16)
    y = mxfp4.mxfp4_linear(x, blocks[0].cuda(), scales[0].cuda())
    torch.testing.assert_close(y, x @ ours[0].T)


GPT_OSS_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def test_gpt_oss_quantization_config_quantizes_only_the_experts():
    quant = parse_quant_config(GPT_OSS_CONFIG, None)
    assert isinstance(quant, MXFP4QuantConfig) and quant.method == "mxfp4"
    assert quant.experts_quantized("model.layers.3.mlp.experts")
    assert not quant.experts_quantized("model.layers.3.self_attn.q_proj")
    assert not quant.experts_quantized("lm_head")
    assert quant.scheme_for(["model.layers.0.self_attn.q_proj"]) is None
    with pytest.raises(ConfigError, match="checkpoint is mxfp4"):
        parse_quant_config(GPT_OSS_CONFIG, "gptq")
    with pytest.raises(ConfigError, match="modules_to_not_convert"):
        parse_quant_config({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, None)


def test_tensor_parallel_sizes_that_cut_an_mxfp4_block_are_refused():
    quant = parse_quant_config(GPT_OSS_CONFIG, None)
    rows = {"intermediate_size": 2880, "num_attention_heads * head_dim": 4096}
    assert quant_tp_problem(2, quant, rows) is None  # 1440 = 45 blocks
    problem = quant_tp_problem(4, quant, rows)
    assert problem is not None and "720 inputs per rank" in problem and "MXFP4 block" in problem

"""The quantized_activations option: int8 reaches every GGUF linear layer (and the products of a whole model run on
it), float stays the default, and what int8 cannot serve is refused at start-up, never run in float."""
from __future__ import annotations

import logging

import pytest
import torch
from checkpoints import make_llama

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.config.engine_args import EngineArgs
from strata.errors import ConfigError
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers.embedding import ParallelLMHead
from strata.layers.quantization import gguf_quants
from strata.layers.quantization.gguf_method import GGUFMethod


def _gguf_layers(llm: LLM) -> list:
    model = llm.engine.executor.runner.model
    return [m for m in model.modules() if isinstance(getattr(m, "quant", None), GGUFMethod)]


def test_int8_reaches_every_gguf_layer_and_its_products_round_x(gguf_tied_q4_1, caplog):
    with caplog.at_level(logging.INFO):
        llm = LLM(str(gguf_tied_q4_1), quantized_activations="int8", max_model_len=64, kv_cache_memory=8 << 20)
    try:
        assert any("int8 activations" in r.getMessage() for r in caplog.records)
        layers = _gguf_layers(llm)
        assert layers and all(m.quant.activations == "int8" for m in layers)
        # the tied head: its table stays in blocks for lookups; products read it (or, where the build has the tile
        # layout, a tiled copy of it: gguf_q8_tiled.h) with x rounded to 8 bits
        head = next(m for m in layers if isinstance(m, ParallelLMHead))
        table, [w] = head.quant.table_blocks(), head.quant.weights
        x = torch.randn(3, head.quant.k, generator=torch.Generator().manual_seed(0))
        y = head.quant.apply(head, x, None)
        int8 = gguf_quants.gguf_linear(x, table.data, table.ggml_type, head.quant.k, activations="int8")
        exact = gguf_quants.gguf_linear(x, table.data, table.ggml_type, head.quant.k)
        torch.testing.assert_close(y, int8, rtol=1e-5, atol=1e-5)  # the same integer sums, scaled in another order
        assert (y - exact).abs().max() > 100 * (y - int8).abs().max()
        assert (w.tiled_rows > 0) == (cpu_matmul.tile_for_int8(table.data, gguf_quants.kernel_kind(table.ggml_type),
                                                               head.quant.k) is not None)
        layer = next(m for m in layers if hasattr(m, "in_range") and not isinstance(m, ParallelLMHead))
        assert all(bool(p.tiled_rows) == bool(w.tiled_rows) for p in layer.quant.weights)  # Q4_1 has the layout too
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
        fused = llm.generate(["hello"], params)[0].outputs[0]
        runner = llm.engine.executor.runner
        if runner.cpu_decode is not None:  # the decode steps in C calls take the int8 kinds too
            assert sum(runner.cpu_decode.served.values()) >= 5
            runner.cpu_decode = None  # then layer by layer through `apply`: the same products
            modules = llm.generate(["hello"], params)[0].outputs[0]
            assert fused.token_ids == modules.token_ids
            for a, b in zip(fused.logprobs, modules.logprobs, strict=True):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    finally:
        llm.shutdown()


def test_float_is_the_default_and_keeps_plain_gguf_methods(gguf_tied_q4_1):
    config = EngineConfig.from_args(EngineArgs(model=str(gguf_tied_q4_1), device="cpu"))
    assert config.model.quant_config.activations == "float"


def test_int8_on_a_file_with_f16_layers_is_refused_at_load_naming_the_types_with_kernels(gguf_all_types):
    with pytest.raises(ConfigError, match="no kernel for GGUF type (F16|BF16).*Q4_0, Q4_1, Q5_0, Q5_1, Q8_0"):
        LLM(str(gguf_all_types), quantized_activations="int8", max_model_len=64, kv_cache_memory=8 << 20)


def test_int8_without_gguf_weights_is_refused(tmp_path):
    folder = make_llama(tmp_path / "llama")
    with pytest.raises(ConfigError, match="applies to the products of GGUF block weights"):
        EngineConfig.from_args(EngineArgs(model=str(folder), device="cpu", quantized_activations="int8"))


def test_an_unknown_value_is_refused(gguf_tied_q4_1):
    with pytest.raises(ConfigError, match="quantized_activations 'int4' is not one of float, int8"):
        EngineConfig.from_args(EngineArgs(model=str(gguf_tied_q4_1), device="cpu", quantized_activations="int4"))

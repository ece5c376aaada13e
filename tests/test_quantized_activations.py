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
        layer = next(m for m in layers if hasattr(m, "in_range"))
        [w] = layer.quant.weights
        x = torch.randn(3, layer.quant.k, generator=torch.Generator().manual_seed(0))
        y = layer.quant.apply(layer, x, None)
        int8 = gguf_quants.gguf_linear(x, w.data, w.ggml_type, layer.quant.k, activations="int8")
        exact = gguf_quants.gguf_linear(x, w.data, w.ggml_type, layer.quant.k)
        assert torch.equal(y, int8) and not torch.equal(y, exact)
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

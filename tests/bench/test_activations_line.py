"""The benchmarks' `CPU kernels:` phrase on GGUF activations: int8 names the routed experts (GGUF blocks, or MXFP4
times Q8_0) when the file has them; float stays one phrase."""
from __future__ import annotations

from types import SimpleNamespace

from strata.bench.activations import gguf_activations
from strata.config.quant_config import GGUFQuantConfig
from strata.gguf.types import MXFP4, Q4_K, Q8_0


def _llm(types: dict[str, int], activations: str) -> SimpleNamespace:
    quant = GGUFQuantConfig(types, activations=activations)
    return SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(quant_config=quant))))


def test_int8_names_the_experts_the_file_has():
    dense = {"model.layers.0.self_attn.q_proj.weight": Q8_0}
    experts = {**dense, "model.layers.0.mlp.experts.gate_proj.weight": Q4_K}
    gpt_oss = {**dense, "model.layers.0.mlp.experts.gate_up_proj_blocks": MXFP4}
    assert "experts" not in gguf_activations(_llm(dense, "int8"))
    assert "routed experts too, each token's row rounded once" in gguf_activations(_llm(experts, "int8"))
    assert "MXFP4 experts times Q8_0 rows" in gguf_activations(_llm(gpt_oss, "int8"))
    assert gguf_activations(_llm(experts, "float")) == "GGUF products with float activations"

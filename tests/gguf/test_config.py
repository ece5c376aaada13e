"""A GGUF file's metadata becomes the config.json of the checkpoint it was converted from; what strata cannot run is
refused before any process starts."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from strata.config import EngineConfig, ModelConfig
from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf.config import hf_config
from strata.gguf.reader import GGUFModel
from strata.model_source import ModelSource

KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
        "eos_token_id")


@pytest.mark.parametrize("fixture", ["gguf_all_types", "gguf_tied_q4_1"])
def test_config_from_metadata_matches_the_converted_checkpoint(fixture, request):
    path = request.getfixturevalue(fixture)
    expected = json.loads((path.parent / "hf" / "config.json").read_text())
    got = hf_config(GGUFModel([path]))
    assert got["architectures"] == ["LlamaForCausalLM"]
    for key in KEYS:
        assert got[key] == expected[key], key
    assert got["rms_norm_eps"] == pytest.approx(expected["rms_norm_eps"])
    assert got["rope_theta"] == pytest.approx((expected.get("rope_parameters") or expected)["rope_theta"])
    assert got["rope_scaling"] is None


def test_gguf_model_config_keeps_quantized_matrices_in_blocks(gguf_all_types):
    config = ModelConfig.from_path(ModelSource(str(gguf_all_types), str(gguf_all_types.parent),
                                               (str(gguf_all_types),)))
    assert config.quantization == "gguf"
    types = config.quant_config.tensor_types
    assert types["model.layers.1.self_attn.v_proj.weight"] == gguf.GGMLQuantizationType.Q6_K
    assert types["model.embed_tokens.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert not any("norm" in name for name in types)  # F32 vectors load as tensors
    with pytest.raises(ConfigError, match="is a GGUF file"):
        ModelConfig.from_path(ModelSource(str(gguf_all_types), str(gguf_all_types.parent), (str(gguf_all_types),)),
                              quantization="awq")


def _write(path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_head_count(2)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_architecture_and_unknown_tensors_are_refused(tmp_path):
    table = {"token_embd.weight": np.zeros((8, 32), dtype=np.float32)}
    _write(tmp_path / "rwkv.gguf", "rwkv6", table)
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'rwkv6' is not supported"):
        EngineConfig.create(str(tmp_path / "rwkv.gguf"), device="cpu")
    _write(tmp_path / "odd.gguf", "llama", {**table, "blk.0.attn_mystery.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(ConfigError, match="tensors strata does not know .*blk.0.attn_mystery.weight"):
        EngineConfig.create(str(tmp_path / "odd.gguf"), device="cpu")


def test_a_layout_that_cuts_a_block_is_refused_naming_sizes_that_work(gguf_all_types, gguf_tied_q4_1):
    with pytest.raises(ConfigError, match="cuts a GGUF block of 256 values; sizes that work: 1$"):
        EngineConfig.create(str(gguf_all_types), tensor_parallel_size=2, device="cpu")
    EngineConfig.create(str(gguf_tied_q4_1), tensor_parallel_size=2, device="cpu")  # 64 inputs per rank: 2 blocks

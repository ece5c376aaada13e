"""Impossible TP x PP layouts are refused at start-up with the field, its value and sizes that work."""
from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from strata import LLM, ConfigError
from strata.config import EngineConfig
from strata.config import model_registry as registry
from strata.executor import multiproc


def write_config(folder: Path, architecture: str = "LlamaForCausalLM", text_config: bool = False, **sizes) -> Path:
    """A checkpoint folder with only config.json: validation never reads weights."""
    values = {"hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 256, **sizes}
    config = {"architectures": [architecture], "text_config": values} if text_config else {
        "architectures": [architecture], **values}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("sizes, layout, param, message", [
    ({}, {"tensor_parallel_size": 3}, "tensor_parallel_size",
     r"tensor_parallel_size=3 must divide num_attention_heads=4; sizes that work for this model: 1, 2, 4$"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 100}, {"tensor_parallel_size": 8},
     "tensor_parallel_size", r"must divide intermediate_size=100; sizes that work for this model: 1, 2, 4$"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 192, "vocab_size": 384},
     {"tensor_parallel_size": 2}, "tensor_parallel_size",
     r"tensor_parallel_size=2 must divide num_key_value_heads=3 or be a multiple of it.*"
     r"sizes that work for this model: 1, 3, 6$"),
    ({"num_attention_heads": 12, "num_key_value_heads": 12, "intermediate_size": 384}, {"tensor_parallel_size": 3},
     "tensor_parallel_size", r"must divide the padded vocabulary 320 \(vocab_size=300 rounded up to a multiple of "
                             r"64\); sizes that work for this model: 1, 2, 4$"),
    ({}, {"pipeline_parallel_size": 6}, "pipeline_parallel_size",
     r"pipeline_parallel_size=6 exceeds the model's 5 layers; use 1 to 5"),
    ({}, {"pipeline_parallel_size": 2, "pp_layer_partition": (2, 2)}, "pp_layer_partition",
     r"pp_layer_partition=2,2 must have 2 positive entries .* sum to the model's 5 layers, e.g. 3,2"),
    ({}, {"pipeline_parallel_size": 3, "pp_layer_partition": (4, 1)}, "pp_layer_partition",
     r"pp_layer_partition=4,1 must have 3 positive entries"),
    ({}, {"tensor_parallel_size": 0}, "tensor_parallel_size", r"must be a positive integer, got 0"),
    ({}, {"tensor_parallel_size": 2, "nnodes": 3, "master_port": 29500}, "nnodes",
     r"nnodes=3 must divide the 2 workers .* nnodes that work: 1, 2"),
    ({}, {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_port": 29500}, "node_rank",
     r"node_rank=2 must be in 0..1"),
    ({}, {"tensor_parallel_size": 2, "nnodes": 2}, "master_port", r"nnodes=2 needs --master-port"),
])
def test_impossible_layouts_are_refused_with_the_sizes_that_work(tmp_path, sizes, layout, param, message):
    folder = write_config(tmp_path / "model", **sizes)
    with pytest.raises(ConfigError, match=message) as error:
        EngineConfig.create(str(folder), device="cpu", **layout)
    assert error.value.param == param


def test_refusal_comes_before_any_worker_starts(llama_gqa, monkeypatch):
    def no_spawn(*args, **kwargs):
        raise AssertionError("a worker was started for an invalid layout")

    monkeypatch.setattr(multiproc, "spawn_workers", no_spawn)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="num_attention_heads=4"):
        LLM(str(llama_gqa), tensor_parallel_size=3, pipeline_parallel_size=2)
    assert time.monotonic() - started < 2
    assert multiprocessing.active_children() == []


def test_multimodal_capabilities_come_from_the_language_model(tmp_path, monkeypatch):
    """A text sub-config has no `architectures`; the registry's text architecture decides, never None."""
    models = dict(registry._MODELS)
    models["FakeVLM"] = registry.ModelInfo("strata.models.llama", "LlamaForCausalLM", is_multimodal=True,
                                           text_architecture="FakeText")
    models["FakeText"] = registry.ModelInfo("strata.models.llama", "LlamaForCausalLM", supports_pp=False)
    monkeypatch.setattr(registry, "_MODELS", models)
    folder = write_config(tmp_path / "vlm", architecture="FakeVLM", text_config=True)
    with pytest.raises(ConfigError, match=r"FakeText \(the language model of FakeVLM\) does not support pipeline "
                                          r"parallelism \(pipeline_parallel_size=2\)"):
        EngineConfig.create(str(folder), device="cpu", pipeline_parallel_size=2)
    # Sizes are read from the text sub-config too.
    with pytest.raises(ConfigError, match="num_attention_heads=4"):
        EngineConfig.create(str(folder), device="cpu", tensor_parallel_size=3)
    assert EngineConfig.create(str(folder), device="cpu", tensor_parallel_size=2).parallel.world_size == 2


def test_workers_must_fit_the_visible_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    folder = write_config(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"4 workers need 4 GPUs on each of 1 node\(s\) but 2 are visible"):
        EngineConfig.create(str(folder), device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2)
    # Over two nodes, each node needs only its share.
    config = EngineConfig.create(str(folder), device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2,
                                 nnodes=2, master_port=29500)
    assert config.parallel.world_size == 4

"""A config.json without `architectures`: its model_type (or auto_map) decides as transformers' Auto classes do,
and what cannot be decided is refused naming the field and how to set it."""
from __future__ import annotations

import json

import pytest
import transformers
from mamba_checkpoints import make_plamo2

from strata.config import ModelConfig
from strata.config.hf_config import HFConfig
from strata.config.model_registry import architecture_of
from strata.errors import UnsupportedModelError

# A checkpoint's config as transformers writes it, and the Auto class that loads such a checkpoint.
CASES = {
    "llama": (transformers.LlamaConfig, transformers.AutoModelForCausalLM),
    "mamba2": (transformers.Mamba2Config, transformers.AutoModelForCausalLM),
    "llama4_text": (transformers.Llama4TextConfig, transformers.AutoModelForCausalLM),
    "llama4": (transformers.Llama4Config, transformers.AutoModelForImageTextToText),
}


def _without_architectures(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "architectures"}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_a_missing_architectures_is_the_class_transformers_auto_loads(model_type):
    config_class, auto_class = CASES[model_type]
    config = config_class()
    expected = auto_class._model_mapping[type(config)].__name__
    values = _without_architectures(config.to_dict())
    assert values["model_type"] == model_type
    assert architecture_of(HFConfig(values)) == expected


def test_a_checkpoint_folder_without_architectures_loads_its_config(tmp_path):
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
    (tmp_path / "config.json").write_text(json.dumps(_without_architectures(config.to_dict())))
    assert ModelConfig.from_path(str(tmp_path)).architecture == "LlamaForCausalLM"


def test_remote_code_model_types_are_named_as_their_checkpoints_name_them(tmp_path):
    written = json.loads((make_plamo2(tmp_path, num_layers=2) / "config.json").read_text())
    assert architecture_of(HFConfig(_without_architectures(written))) == written["architectures"][0]
    auto_mapped = {"model_type": "custom", "auto_map": {"AutoModelForCausalLM": "modeling_x.LlamaForCausalLM"}}
    assert architecture_of(HFConfig(auto_mapped)) == "LlamaForCausalLM"


@pytest.mark.parametrize(("config", "says"), [
    ({"hidden_size": 64}, "nor a model_type to infer one from"),
    ({"model_type": "gpt2"}, "its model_type 'gpt2' names no supported architecture"),
])
def test_an_undecidable_architecture_names_the_field_and_how_to_set_it(tmp_path, config, says):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as caught:
        ModelConfig.from_path(str(tmp_path))
    message = str(caught.value)
    assert 'config.json has no "architectures" field' in message and says in message
    assert 'Add the model class to config.json, e.g. "architectures": ["LlamaForCausalLM"]' in message
    assert caught.value.param == "architectures"


def test_architectures_that_are_not_a_list_of_names_are_refused():
    with pytest.raises(UnsupportedModelError, match='must be a list of class names such as \\["LlamaForCausalLM"\\]'):
        architecture_of(HFConfig({"architectures": "LlamaForCausalLM"}))

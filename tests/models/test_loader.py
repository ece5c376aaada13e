"""The loader is strict: missing, unexpected or misshapen tensors and pickle files are refused."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from strata import LLM, ConfigError, UnsupportedModelError
from strata.models.loader import is_pp_missing


def copy_checkpoint(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_tensor_fails_to_load_naming_it(llama_gqa, tmp_path):
    path = copy_checkpoint(llama_gqa, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(path)


def test_missing_part_of_a_fused_tensor_fails_naming_the_checkpoint_tensor(llama_gqa, tmp_path):
    path = copy_checkpoint(llama_gqa, tmp_path / "m", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing tensors: model\.layers\.0\.self_attn\.k_proj\.weight( |$)"):
        LLM(path)


def test_unexpected_tensor_fails_to_load_naming_it(llama_gqa, tmp_path):
    def add(t):
        t["model.layers.0.extra.weight"] = t["model.norm.weight"].clone()

    with pytest.raises(ConfigError, match=r"unexpected tensors: model\.layers\.0\.extra\.weight"):
        LLM(copy_checkpoint(llama_gqa, tmp_path / "m", add))


def test_shape_mismatch_fails_to_load(llama_gqa, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1].clone()

    with pytest.raises(ConfigError, match="up_proj"):
        LLM(copy_checkpoint(llama_gqa, tmp_path / "m", shrink))


def test_pickle_checkpoints_are_refused(llama_gqa, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(llama_gqa, dst)
    (dst / "model.safetensors").rename(dst / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pickle"):
        LLM(str(dst))


def test_unknown_architecture_lists_the_supported_ones(llama_gqa, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(llama_gqa, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        LLM(str(dst))


def test_not_a_checkpoint_folder_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no folder or file .*nothing.*not a Hub repo ID"):
        LLM(str(tmp_path / "nothing"))


def test_sharded_checkpoint_with_index_loads(llama_gqa, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(llama_gqa, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert LLM(str(dst)).generate("hi", use_tqdm=False)[0].outputs[0].token_ids


def test_pp_missing_prefix_needs_the_trailing_dot():
    assert is_pp_missing("model.layers.1.mlp.weight", ["model.layers.1"])
    assert not is_pp_missing("model.layers.11.mlp.weight", ["model.layers.1"])

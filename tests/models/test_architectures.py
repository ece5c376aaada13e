"""Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3 and Granite against transformers in float32: greedy tokens and their
logprobs with tied and untied heads, the config rules each reads (sliding-window layers, sparse layers, the spellings
of released configs) and the checkpoint layouts each loads (fused q/k/v, experts fused into 3-D tensors)."""
from __future__ import annotations

import pytest
import torch
from arch_checkpoints import (
    ARCHITECTURES,
    COMMON,
    assert_matches_transformers,
    edit_config,
    make_arch,
    random_prompts,
    strata_greedy,
)
from safetensors.torch import save_file

from strata.config import EngineConfig, HFConfig
from strata.errors import ConfigError
from strata.models.dense_decoder import Qwen2Args
from strata.models.qwen3_moe import Qwen3MoeArgs

# Prompt + output (up to 48 tokens) runs past the 16-token windows of Qwen2's and Mistral's checkpoints, and stays
# within Phi-3's original length (64), whose short LongRoPE factors strata_greedy's max_model_len of 64 selects.
PROMPTS = tuple(tuple(p) for p in random_prompts((5, 17, 24)))
MAX_TOKENS = 24


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_tokens_and_logprobs_match_transformers(arch_path, hf_outputs, name, tied):
    path = arch_path(name, tied)
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS), hf_outputs(path, PROMPTS, MAX_TOKENS))


def test_released_config_spellings_load_as_transformers_reads_them(arch_path, hf_outputs, tmp_path):
    """Phi-3 releases: `rope_scaling` of type "su" and a top-level partial_rotary_factor; Qwen3-MoE releases:
    `num_experts` (transformers saves it as num_local_experts), here without renormalised top-k weights."""
    phi3 = make_arch(tmp_path / "phi3", "phi3", seed=2)
    scaling = {"type": "su", **{k: v for k, v in ARCHITECTURES["phi3"][2]["rope_scaling"].items() if k != "type"}}
    edit_config(phi3, rope_parameters=None, rope_scaling=scaling, rope_theta=10000.0, partial_rotary_factor=0.5)
    moe = make_arch(tmp_path / "qwen3_moe", "qwen3_moe", seed=3)
    edit_config(moe, num_local_experts=None, num_experts=4, norm_topk_prob=False)
    for path in (phi3, moe):
        assert_matches_transformers(strata_greedy(path, PROMPTS[:2], 8), hf_outputs(path, PROMPTS[:2], 8))


def test_qwen3_moe_experts_fused_into_3d_tensors_load_like_per_expert_ones(arch_path, hf_outputs, tmp_path):
    """transformers 5 holds experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I]; a checkpoint written from
    that state dict (not by save_pretrained, which splits them per expert) loads too."""
    from transformers import AutoModelForCausalLM

    source = arch_path("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight" or
             not model.config.tie_word_embeddings}
    assert any(t.dim() == 3 for t in state.values())
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(state, str(fused / "model.safetensors"))
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / extra).write_text((source / extra).read_text())
    assert_matches_transformers(strata_greedy(fused, PROMPTS[:2], 8), hf_outputs(source, PROMPTS[:2], 8))


def test_qwen3_moe_experts_int8_greedy_tokens_follow_the_top5_rule(arch_path, hf_outputs):
    """Int8 experts change the logits a little: where the tokens first differ from transformers', each side's token
    is among the other's five most likely."""
    path = arch_path("qwen3_moe")
    outputs = strata_greedy(path, PROMPTS, MAX_TOKENS, quantization="experts_int8")
    for out, want in zip(outputs, hf_outputs(path, PROMPTS, MAX_TOKENS), strict=True):
        got = out.outputs[0]
        differ = [i for i, (a, b) in enumerate(zip(got.token_ids, want["tokens"], strict=True)) if a != b]
        if differ:
            i = differ[0]
            assert got.token_ids[i] in want["logprobs"][i].topk(5).indices.tolist()
            assert want["tokens"][i] in got.logprobs[i]


@pytest.mark.parametrize("use_sliding_window, max_window_layers, layer_types", [
    (True, 1, None), (True, 3, None), (False, 0, None),
    (True, 0, ["full_attention", "sliding_attention", "full_attention"]),
    (False, 0, ["sliding_attention"] * 3),
])
def test_qwen2_windowed_layers_follow_transformers(use_sliding_window, max_window_layers, layer_types):
    from transformers import Qwen2Config

    values = dict(COMMON, use_sliding_window=use_sliding_window, sliding_window=16,
                  max_window_layers=max_window_layers, layer_types=layer_types)
    config = Qwen2Config(**values)
    expected = tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)
    assert Qwen2Args.from_hf(HFConfig({k: v for k, v in values.items() if v is not None})).windows == expected


def test_qwen3_moe_sparse_layers_follow_transformers():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    values = dict(COMMON, **ARCHITECTURES["qwen3_moe"][2], num_hidden_layers=6)
    values.update(decoder_sparse_step=2, mlp_only_layers=[3])
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**values))
    expected = tuple(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers)
    assert expected == (False, True, False, False, False, True)
    assert Qwen3MoeArgs.from_hf(HFConfig(values)).sparse_layers == expected


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_tp_sizes_that_split_a_head_are_refused_before_start(arch_path, name):
    with pytest.raises(ConfigError, match="num_attention_heads=4"):
        EngineConfig.create(str(arch_path(name)), tensor_parallel_size=3, device="cpu")

"""Quantized checkpoints written by real tools (llm-compressor's `oneshot`; GPTQ and AWQ by hand, see hand_packed)
load and run like their oracle: transformers on the same checkpoint (it decompresses compressed-tensors), or the
dense checkpoint of the very weights a hand-packed one encodes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.errors import ConfigError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))
from checkpoints import make_llama  # noqa: E402
from model_forward import strata_logits  # noqa: E402

sys.path.insert(0, str(HERE))
from hand_packed import write_awq_and_dense, write_gptq_and_dense  # noqa: E402
from llmc_env import (  # noqa: E402
    MAX_TOKENS,
    PROMPTS,
    assert_logits_match_oracle,
    llmc_python,
    one_rank_runner,
    relative_error,
)

WEIGHT_ONLY = ["W4A16", "W4A16_ASYM", "W8A16", "W4A16_G32", "W4A16_ASYM_G64", "W4A16_CHANNEL",
               "W4A16_G32_HEAD"]
ACTIVATION_QUANTIZED = ["W8A8", "FP8_DYNAMIC"]


@pytest.fixture(scope="session")
def quant_base(tmp_path_factory) -> Path:
    # Widths that llm-compressor's default group of 128 divides.
    return make_llama(tmp_path_factory.mktemp("quant") / "base", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="session")
def compressed(quant_base) -> dict[str, Path]:
    python = llmc_python()
    parent = quant_base.parent / "llmc"
    schemes = WEIGHT_ONLY + ACTIVATION_QUANTIZED
    subprocess.run([python, str(HERE / "write_llmcompressor_checkpoint.py"), str(quant_base), str(parent),
                    *schemes], check=True, capture_output=True)
    return {s: parent / s for s in schemes}


@pytest.fixture(scope="session")
def oracle(compressed, quant_base) -> dict[str, dict]:
    out = quant_base.parent / "oracle.pt"
    subprocess.run([llmc_python(), str(HERE / "transformers_oracle.py"), json.dumps(PROMPTS), str(MAX_TOKENS), str(out),
                    *map(str, compressed.values())], check=True, capture_output=True)
    results = torch.load(out)
    return {name: results[str(path)] for name, path in compressed.items()}


def _generate(path: Path, logprobs: int | None = None, **options):
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=2**24, max_num_seqs=8, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs))
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_weight_only_checkpoint_matches_transformers_tokens_and_logits(scheme, compressed, oracle):
    expected = oracle[scheme]
    assert [o.token_ids for o in _generate(compressed[scheme])] == expected["tokens"]
    assert_logits_match_oracle(compressed[scheme], expected)


@pytest.mark.parametrize("scheme", ACTIVATION_QUANTIZED)
def test_activation_quantized_checkpoint_meets_the_top5_rule(scheme, compressed, oracle):
    """vLLM's rule: up to the first differing token, and there each side's token is in the other's top 5."""
    expected = oracle[scheme]
    for out, tokens, logits, prompt in zip(_generate(compressed[scheme], logprobs=5), expected["tokens"],
                                           expected["logits"], PROMPTS, strict=True):
        for i, (ours, theirs) in enumerate(zip(out.token_ids, tokens, strict=True)):
            if ours != theirs:
                assert theirs in out.logprobs[i]
                assert ours in logits[len(prompt) - 1 + i].topk(5).indices.tolist()
                break


def test_stored_weights_stay_quantized_in_memory(compressed):
    runner = one_rank_runner(compressed["W4A16"])
    proj = runner.model.model.layers[0].self_attn.qkv_proj
    assert proj.quant.weight.bits == 4 and not hasattr(proj, "weight")
    assert proj.quant.nbytes < proj.quant.n * proj.quant.k  # under a byte a weight


def test_a_quantized_lm_head_stays_quantized_and_splits_its_vocabulary_across_tp(compressed):
    path = compressed["W4A16_G32_HEAD"]
    runner = one_rank_runner(path)
    head = runner.model.lm_head
    assert head.quant.weight.bits == 4 and not hasattr(head, "weight")
    assert [o.token_ids for o in _generate(path, tensor_parallel_size=2)] == [o.token_ids for o in _generate(path)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_tp2_and_pp2_give_the_tokens_of_one_rank(layout, compressed):
    path = compressed["W4A16_ASYM_G64"]
    assert [o.token_ids for o in _generate(path, **layout)] == [o.token_ids for o in _generate(path)]


def test_tp_size_that_cuts_a_group_is_refused_before_start(compressed):
    with pytest.raises(ConfigError, match=r"quantization group of 128.*sizes that work: 1\b"):
        EngineConfig.create(str(compressed["W4A16"]), tensor_parallel_size=2)


@pytest.mark.parametrize("kind", ["gptq4_sym", "gptq4_asym_desc_act", "gptq8_channel", "gptq4_asym_g32_desc_act",
                                  "awq"])
def test_hand_packed_gptq_and_awq_match_their_dense_weights(kind, quant_base, tmp_path):
    packed, dense = tmp_path / "packed", tmp_path / "dense"
    if kind == "awq":
        write_awq_and_dense(quant_base, packed, dense, group=64)
    else:
        bits = 8 if "gptq8" in kind else 4
        group = -1 if "channel" in kind else 32 if "g32" in kind else 64
        write_gptq_and_dense(quant_base, packed, dense, bits, group, "asym" not in kind, "desc_act" in kind)
    sequence = PROMPTS[0] + list(range(10, 30))
    assert relative_error(strata_logits(packed, sequence), strata_logits(dense, sequence)) < 1e-3
    assert [o.token_ids for o in _generate(packed)][:2] == [o.token_ids for o in _generate(dense)][:2]


@pytest.mark.slow
def test_gptq_tp2_gives_the_tokens_of_one_rank(quant_base, tmp_path):
    write_gptq_and_dense(quant_base, tmp_path / "p", tmp_path / "d", 4, 64, False, False)
    assert [o.token_ids for o in _generate(tmp_path / "p", tensor_parallel_size=2)] == \
        [o.token_ids for o in _generate(tmp_path / "p")]


def _broken_copy(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config["quantization_config"]["config_groups"]["group_0"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_bad_checkpoints_are_config_errors_naming_the_tensor_or_field(compressed, tmp_path):
    src = compressed["W4A16"]
    missing = _broken_copy(src, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"))
    with pytest.raises(ConfigError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        LLM(model=str(missing))
    name = "model.layers.0.mlp.up_proj.weight_packed"
    cut = _broken_copy(src, tmp_path / "cut", lambda t: t.update({name: t[name][:, :-2].contiguous()}))
    with pytest.raises(ConfigError, match=r"up_proj\.weight_packed"):
        LLM(model=str(cut))
    unknown = _broken_copy(src, tmp_path / "unknown", edit_config=lambda g: g.update(format="marlin-24"))
    with pytest.raises(ConfigError, match=r"format='marlin-24' is not supported"):
        EngineConfig.create(str(unknown))
    three = _broken_copy(src, tmp_path / "three", edit_config=lambda g: g["weights"].update(num_bits=3))
    with pytest.raises(ConfigError, match=r"weights\.num_bits=3 is not supported"):
        EngineConfig.create(str(three))


def test_quantization_option_insists_on_the_checkpoint_method(compressed, quant_base):
    assert EngineConfig.create(str(compressed["W4A16"]), quantization="compressed-tensors").model.quant_config
    with pytest.raises(ConfigError, match="checkpoint is compressed-tensors"):
        EngineConfig.create(str(compressed["W4A16"]), quantization="gptq")
    with pytest.raises(ConfigError, match="has no quantization_config"):
        EngineConfig.create(str(quant_base), quantization="awq")


def test_plan_counts_the_stored_quantized_bytes(compressed, quant_base):
    from strata.plan import plan_layout
    quantized = plan_layout(EngineConfig.create(str(compressed["W4A16"])))[0].param_bytes
    full = plan_layout(EngineConfig.create(str(quant_base)))[0].param_bytes
    embed_and_head = 2 * 320 * 128 * 4  # float32 embedding and LM head (ignored) stay as they are
    # 4-bit linear weights: an eighth of their float32 bytes, plus scales.
    assert quantized - embed_and_head < (full - embed_and_head) / 6

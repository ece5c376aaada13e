"""A Llama 4 MoE checkpoint whose routed experts llm-compressor's `oneshot` quantized one by one (as in Scout's
W4A16 checkpoints) loads with its experts packed and runs like its oracle: transformers on the dense checkpoint
that compressed-tensors' own decompression makes of the very same file. GPTQ and AWQ per-expert layouts (packed
by hand, see hand_packed) run like the dense checkpoint of the weights they encode."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.errors import ConfigError
from strata.layers.moe import FusedMoE

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))
from llama4_checkpoints import make_llama4_multimodal, make_llama4_text  # noqa: E402
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
from test_checkpoint_formats import _broken_copy  # noqa: E402

# Group 32 divides the experts' width on each of 2 TP ranks (64 / 2), not on 4.
SCHEMES = ["W4A16_G32", "W4A16_ASYM_G32", "W8A16_CHANNEL"]
EXPERTS = "model.layers.1.feed_forward.experts"


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory) -> Path:
    return make_llama4_text(tmp_path_factory.mktemp("moe_quant") / "base", intermediate_size=64)


@pytest.fixture(scope="module")
def moe_compressed(moe_base) -> dict[str, Path]:
    parent = moe_base.parent / "llmc"
    subprocess.run([llmc_python(), str(HERE / "write_llmcompressor_checkpoint.py"), str(moe_base), str(parent),
                    *SCHEMES], check=True, capture_output=True)
    return {s: parent / s for s in SCHEMES}


@pytest.fixture(scope="module")
def moe_oracle(moe_compressed) -> dict[str, dict]:
    dense = {scheme: path.parent / f"{scheme}-dense" for scheme, path in moe_compressed.items()}
    pairs = [str(p) for scheme, path in moe_compressed.items() for p in (path, dense[scheme])]
    subprocess.run([llmc_python(), str(HERE / "decompress_checkpoint.py"), *pairs], check=True, capture_output=True)
    out = next(iter(dense.values())).parent / "oracle.pt"
    subprocess.run([llmc_python(), str(HERE / "transformers_oracle.py"), json.dumps(PROMPTS), str(MAX_TOKENS), str(out),
                    *map(str, dense.values())], check=True, capture_output=True)
    results = torch.load(out)
    return {scheme: results[str(path)] for scheme, path in dense.items()}


def _tokens(path: Path, **options) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=2**24, max_num_seqs=8, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_oneshot_stores_every_routed_expert_quantized_on_its_own(moe_compressed):
    with safe_open(str(moe_compressed["W4A16_G32"] / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert {f"{EXPERTS}.{e}.{proj}.weight_packed", f"{EXPERTS}.{e}.{proj}.weight_scale"} <= names
    assert "model.layers.1.feed_forward.router.weight" in names


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_experts_match_the_decompressed_checkpoint_in_transformers(scheme, moe_compressed, moe_oracle):
    expected = moe_oracle[scheme]
    assert _tokens(moe_compressed[scheme]) == expected["tokens"]
    assert_logits_match_oracle(moe_compressed[scheme], expected)


def test_experts_stay_packed_in_memory(moe_compressed):
    runner = one_rank_runner(moe_compressed["W4A16_G32"])
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2
    for moe in layers:
        assert not hasattr(moe, "gate_up_proj") and not list(moe.parameters())
        assert {w.bits for w in moe.quant.gate_up + moe.quant.down} == {4}
        assert len(moe.quant.gate_up) == len(moe.quant.down) == moe.num_experts
        weights = 3 * moe.num_experts * moe.intermediate_size * moe.hidden_size
        assert moe.expert_bytes < weights  # under a byte a weight


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_tp2_and_pp2_give_the_tokens_of_one_rank(layout, moe_compressed):
    path = moe_compressed["W4A16_ASYM_G32"]
    assert _tokens(path, **layout) == _tokens(path)


def test_tp_size_that_cuts_a_group_of_the_experts_down_proj_is_refused(moe_compressed):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 splits intermediate_size=64 into 16 .* group of "
                                          r"32; sizes that work: 1, 2\b"):
        EngineConfig.create(str(moe_compressed["W4A16_G32"]), tensor_parallel_size=4)


def test_missing_expert_scale_is_a_config_error_naming_the_tensor(moe_compressed, tmp_path):
    name = f"{EXPERTS}.2.down_proj.weight_scale"
    missing = _broken_copy(moe_compressed["W4A16_G32"], tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ConfigError, match=rf"missing tensors: {name.replace('.', '[.]')}"):
        LLM(model=str(missing))


def test_cut_expert_tensor_is_a_config_error_naming_it(moe_compressed, tmp_path):
    name = f"{EXPERTS}.1.up_proj.weight_packed"
    cut = _broken_copy(moe_compressed["W4A16_G32"], tmp_path / "cut",
                       lambda t: t.update({name: t[name][:-8].contiguous()}))
    with pytest.raises(ConfigError, match=name.replace(".", "[.]")):
        LLM(model=str(cut))


def test_activation_quantized_experts_are_refused_naming_the_scheme(moe_compressed, tmp_path):
    def to_w8a8(group: dict) -> None:
        group.update(format="int-quantized", input_activations={"dynamic": True, "strategy": "token",
                                                                "num_bits": 8, "type": "int"})
        group["weights"].update(num_bits=8, strategy="channel")

    w8a8 = _broken_copy(moe_compressed["W4A16_G32"], tmp_path / "w8a8", edit_config=to_w8a8)
    with pytest.raises(ConfigError, match=r"experts: routed experts stored as int-quantized .* not supported"):
        LLM(model=str(w8a8))


def test_plan_counts_the_packed_expert_bytes(moe_compressed, moe_base):
    from strata.plan import plan_layout
    quantized = plan_layout(EngineConfig.create(str(moe_compressed["W4A16_G32"])))[0].param_bytes
    full = plan_layout(EngineConfig.create(str(moe_base)))[0].param_bytes
    embed_head_router = (2 * 512 * 64 + 2 * 4 * 64) * 4  # float32, left unquantized
    # 4-bit weights (experts included): an eighth of their float32 bytes, plus scales.
    assert quantized - embed_head_router < (full - embed_head_router) / 6


def test_multimodal_checkpoint_runs_its_quantized_experts_like_the_decompressed_one(tmp_path):
    """Scout ships as Llama4ForConditionalGeneration: its layer names (and the quantization config's ignore
    list) start with `language_model.`. Oracle: strata's dense path (checked against transformers in
    tests/models/test_llama4_vision.py) on compressed-tensors' decompression of the same file."""
    base = make_llama4_multimodal(tmp_path / "base", text_overrides={"intermediate_size": 64})
    subprocess.run([llmc_python(), str(HERE / "write_llmcompressor_checkpoint.py"), str(base), str(tmp_path),
                    "W4A16_G32"], check=True, capture_output=True)
    quantized, dense = tmp_path / "W4A16_G32", tmp_path / "dense"
    subprocess.run([llmc_python(), str(HERE / "decompress_checkpoint.py"), str(quantized), str(dense)], check=True,
                   capture_output=True)
    with safe_open(str(quantized / "model.safetensors"), framework="pt") as f:
        assert f"language_model.{EXPERTS}.0.gate_proj.weight_packed" in f.keys()
    assert _tokens(quantized)[:3] == _tokens(dense)[:3]
    sequence = PROMPTS[0] + list(range(10, 40))
    assert relative_error(strata_logits(quantized, sequence), strata_logits(dense, sequence)) < 1e-3


@pytest.fixture(scope="module")
def per_expert_base(tmp_path_factory) -> Path:
    return make_llama4_text(tmp_path_factory.mktemp("moe_hand") / "base", intermediate_size=64, per_expert=True)


def _hand_packed(kind: str, base: Path, folder: Path) -> tuple[Path, Path]:
    packed, dense = folder / "packed", folder / "dense"
    if kind == "awq":
        write_awq_and_dense(base, packed, dense, group=32)
    else:
        bits = 8 if "gptq8" in kind else 4
        write_gptq_and_dense(base, packed, dense, bits, -1 if "channel" in kind else 32, "asym" not in kind,
                             "desc_act" in kind)
    with safe_open(str(packed / "model.safetensors"), framework="pt") as f:
        assert f"{EXPERTS}.3.down_proj.qweight" in f.keys()
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["router"]  # hand_packed leaves it dense
    (packed / "config.json").write_text(json.dumps(config))
    return packed, dense


@pytest.mark.parametrize("kind", ["gptq4_sym", "gptq4_asym_desc_act", "gptq8_channel", "awq"])
def test_hand_packed_gptq_and_awq_experts_match_their_dense_weights(kind, per_expert_base, tmp_path):
    packed, dense = _hand_packed(kind, per_expert_base, tmp_path)
    sequence = PROMPTS[0] + list(range(10, 40))
    assert relative_error(strata_logits(packed, sequence), strata_logits(dense, sequence)) < 1e-3
    assert _tokens(packed)[:3] == _tokens(dense)[:3]


@pytest.mark.slow
def test_gptq_experts_tp2_give_the_tokens_of_one_rank(per_expert_base, tmp_path):
    packed, _ = _hand_packed("gptq4_asym", per_expert_base, tmp_path)
    assert _tokens(packed, tensor_parallel_size=2) == _tokens(packed)


def test_activation_ordered_experts_refuse_tp2(per_expert_base, tmp_path):
    packed, _ = _hand_packed("gptq4_sym_desc_act", per_expert_base, tmp_path)
    with pytest.raises(ConfigError, match=r"activation-ordered groups"):
        _tokens(packed, tensor_parallel_size=2)

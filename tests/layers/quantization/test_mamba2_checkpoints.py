"""A Mamba2 checkpoint quantized by llm-compressor's `oneshot` (every in_proj / out_proj) runs like transformers on
the same checkpoint, under TP=2 and PP=2 like one rank; TP sizes that cut a group or a packed element are refused;
weight bytes count what the quantized layers hold."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.errors import ConfigError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))
from llmc_env import MAX_TOKENS, PROMPTS, assert_logits_match_oracle, llmc_python, one_rank_runner  # noqa: E402
from mamba_checkpoints import make_mamba2  # noqa: E402

# Group 128 (W4A16) cuts out_proj's 256 inputs for TP=4; the asymmetric one's zero points are packed 8 outputs to
# an int32, so its 16 dt rows split into 8 per rank at TP=2 but would cut an element at TP=4.
SCHEMES = ["W4A16", "W4A16_ASYM_G32"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    # hidden 128: llm-compressor's group of 128 must divide in_proj's inputs; the prompts use ids up to 300.
    return make_mamba2(tmp_path_factory.mktemp("mamba2_quant") / "base", hidden_size=128, num_heads=16, head_dim=16,
                       vocab_size=320, seed=3)


@pytest.fixture(scope="module")
def compressed(base) -> dict[str, Path]:
    subprocess.run([llmc_python(), str(HERE / "write_llmcompressor_checkpoint.py"), str(base), str(base.parent),
                    *SCHEMES], check=True, capture_output=True)
    return {s: base.parent / s for s in SCHEMES}


@pytest.fixture(scope="module")
def oracle(compressed, base) -> dict[str, dict]:
    out = base.parent / "oracle.pt"
    subprocess.run([llmc_python(), str(HERE / "transformers_oracle.py"), json.dumps(PROMPTS), str(MAX_TOKENS),
                    str(out), *map(str, compressed.values())], check=True, capture_output=True)
    results = torch.load(out)
    return {name: results[str(path)] for name, path in compressed.items()}


def _generate(path: Path, **options) -> list[list[int]]:
    with LLM(model=str(path), dtype="float32", kv_cache_memory=2**24, max_num_seqs=8, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_mamba2_matches_transformers_tokens_and_logits(scheme, compressed, oracle):
    expected = oracle[scheme]
    assert _generate(compressed[scheme]) == expected["tokens"]
    assert_logits_match_oracle(compressed[scheme], expected)


def test_every_mixer_linear_stays_quantized(compressed):
    runner = one_rank_runner(compressed["W4A16_ASYM_G32"])
    for layer in runner.model.backbone.layers:
        for proj in (layer.mixer.in_proj, layer.mixer.out_proj):
            assert proj.quant.weight.bits == 4 and proj.quant.weight.zeros is not None and not hasattr(proj, "weight")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_tp2_and_pp2_give_the_tokens_of_one_rank(scheme, layout, compressed, oracle):
    assert _generate(compressed[scheme], **layout) == oracle[scheme]["tokens"]


def test_tp_size_that_cuts_a_group_or_a_packed_element_is_refused_before_start(compressed):
    with pytest.raises(ConfigError, match=r"expand \* hidden_size=256 .* quantization group of 128; "
                                          r"sizes that work: 1, 2$"):
        EngineConfig.create(str(compressed["W4A16"]), tensor_parallel_size=4)
    with pytest.raises(ConfigError, match=r"2 rows of num_heads \(dt\)=16 .* packed element of 8 outputs .* "
                                          r"sizes that work: 1, 2$"):
        EngineConfig.create(str(compressed["W4A16_ASYM_G32"]), tensor_parallel_size=8)


def test_plan_and_runner_count_the_quantized_bytes(compressed, base):
    from strata.plan import plan_layout
    path = compressed["W4A16"]
    quantized = plan_layout(EngineConfig.create(str(path)))[0].param_bytes
    full = plan_layout(EngineConfig.create(str(base)))[0].param_bytes
    embed_and_head = 2 * 320 * 128 * 4  # float32 embedding and LM head (ignored) stay as they are
    linears = 3 * (128 * 552 + 256 * 128) * 4  # in_proj and out_proj of 3 layers in float32
    assert quantized - embed_and_head < full - embed_and_head - linears * 6 / 7  # 4 bits a weight, plus scales
    held = one_rank_runner(path).weight_bytes
    weight_shapes = 3 * 2 * 2 * 8  # the int64 [2] weight_shape of each linear: planned, not held
    assert held == quantized - weight_shapes

"""Qwen3 and Qwen3-MoE checkpoints quantized W4A16 by llm-compressor's `oneshot` (every linear layer, and every routed
expert one by one, as released Qwen3 W4A16 checkpoints are; the router and the LM head left as they are) run like
transformers with compressed-tensors on the same checkpoints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from strata import LLM, SamplingParams
from strata.layers.moe import FusedMoE

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))
from arch_checkpoints import make_arch  # noqa: E402
from llmc_env import MAX_TOKENS, PROMPTS, assert_logits_match_oracle, llmc_python, one_rank_runner  # noqa: E402

SCHEME = "W4A16"  # llm-compressor's preset: 4-bit symmetric groups of 128
# Widths the group of 128 divides: hidden 128, 4 heads of 32, MLP 256, experts 128.
SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """{architecture: (quantized folder, transformers' tokens and logits on it)}."""
    root = tmp_path_factory.mktemp("qwen3_quant")
    bases = {"qwen3": make_arch(root / "qwen3", "qwen3", seed=4, **SIZES),
             "qwen3_moe": make_arch(root / "qwen3_moe", "qwen3_moe", seed=5, moe_intermediate_size=128, **SIZES)}
    out = root / "oracle.pt"
    subprocess.run([llmc_python(), str(HERE / "quantize_with_oracle.py"), json.dumps(PROMPTS), str(MAX_TOKENS),
                    str(out), SCHEME, *map(str, bases.values())], check=True, capture_output=True)
    results = torch.load(out)
    return {name: (base.parent / f"{base.name}-{SCHEME}", results[str(base.parent / f"{base.name}-{SCHEME}")])
            for name, base in bases.items()}


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_w4a16_checkpoint_matches_transformers_tokens_and_logits(quantized, name):
    path, expected = quantized[name]
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=2**24, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected["tokens"]
    assert_logits_match_oracle(path, expected)


def test_linears_and_experts_stay_packed_and_the_router_stays_dense(quantized):
    model = one_rank_runner(quantized["qwen3_moe"][0]).model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant.weight.bits == 4 and not hasattr(layer.self_attn.qkv_proj, "weight")
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all(m.quant is not None for m in experts)
    assert layer.mlp.gate.quant is None and layer.mlp.gate.weight.dtype == torch.float32

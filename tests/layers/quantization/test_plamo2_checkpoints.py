"""A PLaMo2 checkpoint whose every linear layer (Mamba in_proj / bcdt_proj / dt_proj / out_proj, attention qkv / o,
MLP) compressed-tensors quantized runs like mlx-lm's PLaMo2 given the weights compressed-tensors decompresses from
it; TP=2 and PP=2 give the tokens of one rank."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.errors import ConfigError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))
from llmc_env import MAX_TOKENS, PROMPTS, llmc_python, one_rank_runner, relative_error  # noqa: E402
from mamba_checkpoints import make_plamo2, one_torch_thread  # noqa: E402, F401 (fixture)
from model_forward import strata_logits  # noqa: E402
from plamo2_oracle import mlx_greedy, mlx_logits, needs_mlx  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# dt_proj has 64 inputs, so groups of 64 at most; 16 Mamba heads leave 8 dt rows per rank at TP=2, a whole int32
# of the asymmetric scheme's packed zero points.
SCHEMES = ["W4A16_G64", "W4A16_ASYM_G32"]
LINEARS_PER_LAYER = {"mamba": 4 + 2, "attention": 2 + 2}  # mixer linears + MLP gate_up and down


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_plamo2(tmp_path_factory.mktemp("plamo2_quant") / "base", hidden_size=128, num_heads=8,
                       num_kv_heads=2, head_dim=16, mamba_num_heads=16, intermediate_size=256, vocab_size=320,
                       num_layers=4, seed=5)


@pytest.fixture(scope="module")
def compressed(base) -> dict[str, tuple[Path, Path]]:
    """scheme -> (compressed checkpoint, the dense one compressed-tensors decompresses it into)."""
    subprocess.run([llmc_python(), str(HERE / "write_compressed_tensors_plamo2.py"), str(base), str(base.parent),
                    *SCHEMES], check=True, capture_output=True)
    return {s: (base.parent / s, base.parent / f"{s}-dense") for s in SCHEMES}


def _generate(path: Path, **options) -> list[list[int]]:
    with LLM(model=str(path), dtype="float32", kv_cache_memory=2**24, max_num_seqs=8, max_model_len=128,
             **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@needs_mlx
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_plamo2_matches_mlx_on_the_decompressed_weights(scheme, compressed):
    path, dense = compressed[scheme]
    tokens = _generate(path)
    for prompt, ours in zip(PROMPTS, tokens, strict=True):
        assert ours == mlx_greedy(dense, prompt, MAX_TOKENS)
        assert relative_error(strata_logits(path, prompt + ours), mlx_logits(dense, prompt + ours)) < 1e-3


def test_every_linear_layer_is_quantized(compressed):
    runner = one_rank_runner(compressed["W4A16_ASYM_G32"][0])
    for layer in runner.model.model.layers.layers:
        quantized = [m for m in layer.modules() if getattr(m, "quant", None) is not None]
        assert len(quantized) == LINEARS_PER_LAYER["mamba" if layer.is_mamba else "attention"]
        assert all(m.quant.weight.zeros is not None and not hasattr(m, "weight") for m in quantized)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_tp2_and_pp2_give_the_tokens_of_one_rank(scheme, layout, compressed):
    path = compressed[scheme][0]
    assert _generate(path, **layout) == _generate(path)


def test_tp_size_that_cuts_a_group_or_a_packed_element_is_refused_before_start(compressed):
    with pytest.raises(ConfigError, match=r"num_attention_heads \* head_dim=128 .* quantization group of 64; "
                                          r"sizes that work: 1, 2$"):
        EngineConfig.create(str(compressed["W4A16_G64"][0]), tensor_parallel_size=4)
    with pytest.raises(ConfigError, match=r"4 rows of mamba_num_heads \(dt\)=16 .* packed element of 8 outputs"):
        EngineConfig.create(str(compressed["W4A16_ASYM_G32"][0]), tensor_parallel_size=4)

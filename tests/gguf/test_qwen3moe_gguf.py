"""Qwen3-MoE GGUF files whose routed experts stay in their ggml blocks, from a tiny random checkpoint converted by
llama.cpp's own converter: its Q8_0 file (every matrix, experts included), a copy with Q4_K gate, Q5_K up and Q6_K
down experts (blocks packed by tests/gguf_packing.py: gguf-py has no K-quant quantizer), and, where the binary is
built, llama-quantize's Q4_K_M file. Each gives transformers' greedy tokens and logprobs on THE SAME FILE (which
transformers dequantizes); TP=2 and PP=2 give one process's tokens; a TP size that would cut a block of the experts'
down projection is refused before any process starts, naming the tensor and its block."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import gguf
import pytest
from arch_checkpoints import assert_matches_transformers, make_arch, random_prompts, strata_greedy, transformers_greedy
from gguf_packing import Q4_K, Q5_K, Q6_K, with_expert_types
from llama_cpp_gguf import LLAMA_CPP, convert_many

from strata.config import EngineConfig
from strata.errors import ConfigError

PROMPTS = random_prompts((1, 5, 24), seed=7)  # a one-token prompt: its first step is a decode-sized batch
MAX_TOKENS = 8
# Every layer sparse (the converter writes no dense-layer list). transformers' GGUF reader does not map
# qwen3moe.expert_feed_forward_length and builds experts of its Qwen3MoeConfig default, 768 (Qwen3-30B-A3B's
# width): the checkpoint has that width. 768 is three K-quant blocks, so TP=2 would cut one.
QWEN3MOE = dict(num_hidden_layers=2, mlp_only_layers=[], hidden_size=256, moe_intermediate_size=768)
K_QUANTS = {"gate": Q4_K, "up": Q5_K, "down": Q6_K}
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")
LLAMA_QUANTIZE = LLAMA_CPP / "build" / "bin" / "llama-quantize"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """{"f32", "q8_0", "k-quants": GGUF file}, all in one folder."""
    root = tmp_path_factory.mktemp("gguf_experts")
    hf = make_arch(root / "hf", "qwen3_moe", seed=5, **QWEN3MOE)
    f32, q8_0 = convert_many([(hf, root / "f32.gguf", "f32"), (hf, root / "q8_0.gguf", "q8_0")])
    return {"f32": f32, "q8_0": q8_0, "k-quants": with_expert_types(f32, root / "k-quants.gguf", K_QUANTS)}


def expert_types(path: Path) -> set[str]:
    return {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if _EXPERTS.match(t.name)}


def assert_matches_transformers_on_the_file(path: Path) -> None:
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_greedy(path.parent, PROMPTS, MAX_TOKENS, gguf_file=path.name))


def test_q8_0_experts_give_transformers_tokens_of_the_same_file(files):
    assert expert_types(files["q8_0"]) == {"Q8_0"}
    assert_matches_transformers_on_the_file(files["q8_0"])


def test_k_quant_experts_give_transformers_tokens_of_the_same_file(files):
    """Gate and up in different types: two products where one type would make one."""
    assert expert_types(files["k-quants"]) == {"Q4_K", "Q5_K", "Q6_K"}
    assert_matches_transformers_on_the_file(files["k-quants"])


@pytest.mark.skipif(not LLAMA_QUANTIZE.is_file(), reason=f"no llama-quantize at {LLAMA_QUANTIZE} (CI: the K-quant "
                                                         "test above covers Q4_K / Q5_K / Q6_K experts)")
def test_llama_quantize_q4_k_m_file_gives_transformers_tokens_of_the_same_file(files):
    path = files["f32"].parent / "q4_k_m.gguf"
    env = {**os.environ, "LD_LIBRARY_PATH": str(LLAMA_QUANTIZE.parent)}
    done = subprocess.run([str(LLAMA_QUANTIZE), str(files["f32"]), str(path), "Q4_K_M"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Q4_K" in expert_types(path)
    assert_matches_transformers_on_the_file(path)


def test_tp_that_cuts_an_expert_block_is_refused_naming_the_tensor(files):
    """768 inputs of down (Q6_K, blocks of 256) would leave 384 on each of 2 ranks; Q8_0's blocks of 32 divide."""
    with pytest.raises(ConfigError, match=r"'blk\.0\.ffn_down_exps\.weight' \(Q6_K, blocks of 256 values; "
                                          r"moe_intermediate_size=768\) into 384 per rank"):
        EngineConfig.create(str(files["k-quants"]), dtype="float32", device="cpu", tensor_parallel_size=2)
    EngineConfig.create(str(files["q8_0"]), dtype="float32", device="cpu", tensor_parallel_size=2)


def test_each_rank_holds_its_stage_s_experts_in_blocks_and_its_share_of_them(files):
    """The plan's meta model of each of TP=2 x PP=2 ranks: only its stage's layer has experts, in blocks, and the two
    TP ranks of a stage hold between them exactly the bytes the file stores for that layer's experts."""
    from strata.layers.moe import FusedMoE
    from strata.plan import rank_model

    config = EngineConfig.create(str(files["q8_0"]), dtype="float32", device="cpu", tensor_parallel_size=2,
                                 pipeline_parallel_size=2)
    stored = {}
    for t in gguf.GGUFReader(str(files["q8_0"])).tensors:
        if _EXPERTS.match(t.name):
            stored[int(t.name.split(".")[1])] = stored.get(int(t.name.split(".")[1]), 0) + int(t.n_bytes)
    held = {}
    for rank in range(4):
        layers = [m for m in rank_model(config, rank).modules() if isinstance(m, FusedMoE)]
        assert len(layers) == 1 and layers[0].quant is not None
        held[rank // 2] = held.get(rank // 2, 0) + layers[0].expert_bytes
    assert held == stored


@pytest.mark.slow
def test_tp2_pp2_give_the_tokens_of_one_process(files):
    """Four ranks: each expert's gate/up rows and down inputs split by TP=2 (at Q8_0 block boundaries), one layer
    (and its experts only) on each PP stage."""
    path = files["q8_0"]
    one = [o.outputs[0].token_ids for o in strata_greedy(path, PROMPTS, MAX_TOKENS)]
    split = strata_greedy(path, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [o.outputs[0].token_ids for o in split] == one


def test_int8_activations_run_the_experts_from_rows_rounded_once_near_the_float_logprobs(files):
    """quantized_activations=int8 (Q8_0 file: every matrix has int8 kernels): the routed experts round each step's
    rows once for all their experts (the fused gate/up of every layer), and the first token's logprobs stay within
    rounding of the float path's."""
    from strata import LLM, SamplingParams
    from strata.kernels.cpu import matmul as cpu_matmul
    from strata.layers.moe import FusedMoE

    path, params = files["q8_0"], SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    exact = LLM(str(path), dtype="float32", device="cpu", max_model_len=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, quantized_activations="int8")
    experts = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.quant.activations == "int8" for m in experts)
    rounded, round_rows = [], cpu_matmul.round_rows
    cpu_matmul.round_rows = lambda rows, per_block: rounded.append(rows.shape[0]) or round_rows(rows, per_block)
    try:
        int8 = llm.generate(prompts, params, use_tqdm=False)
    finally:
        cpu_matmul.round_rows = round_rows
    assert rounded == [sum(len(p) for p in PROMPTS)] * len(experts)  # one prefill step: once a layer
    # Every product of this random model rounds x (its attention too): first-token logprobs move by up to ~0.12.
    differences = []
    for a, b in zip(exact, int8, strict=True):
        want, got = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        differences += [abs(want[t].logprob - got[t].logprob) for t in want.keys() & got.keys()]
    assert len(differences) >= 3 * len(PROMPTS) and 0 < max(differences) < 0.25

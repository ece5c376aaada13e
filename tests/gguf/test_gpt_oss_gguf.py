"""gpt-oss GGUF files written by llama.cpp's own converter: with the experts in llama.cpp's MXFP4 (kept 4-bit, the
checkpoint's very codes and exponents) and with float experts, strata gives the tokens and logprobs transformers
gives the checkpoint the file came from (dequantizing its MXFP4 experts); metadata it does not read and TP sizes that
cut an MXFP4 block are refused. transformers' own GGUF loader cannot read these files (it fails on their YaRN keys)."""
from __future__ import annotations

import pytest
import torch
from arch_checkpoints import assert_matches_transformers, make_gpt_oss, random_prompts, strata_greedy
from llama_cpp_gguf import convert
from safetensors.torch import load_file

from strata.config import EngineConfig
from strata.errors import ConfigError, UnsupportedModelError
from strata.gguf.config import hf_config
from strata.gguf.reader import GGUFModel

PROMPTS = random_prompts((5, 11, 40), seed=7)  # 40 tokens: more rows through an expert than the C kernel takes
MAX_TOKENS = 16
# llama.cpp's gpt-oss has the released SwiGLU limit built in (the file cannot carry another); experts of width 64
# leave each of two TP ranks whole MXFP4 blocks.
SHAPE = dict(swiglu_limit=7.0, intermediate_size=64)


def make_mxfp4_gpt_oss(folder, seed: int = 0):
    from strata.bench.random_model import experts_as_mxfp4

    path = make_gpt_oss(folder, seed=seed, **SHAPE)
    experts_as_mxfp4(path, seed)
    return path


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(the MXFP4 checkpoint, its GGUF file)."""
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    hf = make_mxfp4_gpt_oss(root / "hf")
    return hf, convert(hf, root / "gpt_oss-mxfp4.gguf")


def transformers_outputs(model, prompts, max_tokens: int) -> list[dict]:
    """transformers' greedy continuation by full forward passes, and the log-softmax at every generated position."""
    results = []
    with torch.no_grad():
        for prompt in prompts:
            sequence = list(prompt)
            for _ in range(max_tokens):
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
            logits = model(torch.tensor([sequence[:-1]])).logits[0, len(prompt) - 1:]
            results.append({"tokens": sequence[len(prompt):], "logprobs": torch.log_softmax(logits, dim=-1)})
    return results


def test_mxfp4_file_gives_transformers_tokens_of_the_checkpoint(mxfp4):
    """transformers (told to dequantize, on CPU) runs the checkpoint's MXFP4 experts exactly in float32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf, path = mxfp4
    assert {e.ggml_type for n, e in GGUFModel([path]).tensors.items() if "_exps.weight" in n} == {39}  # MXFP4
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    assert_matches_transformers(strata_greedy(path, PROMPTS, MAX_TOKENS),
                                transformers_outputs(model, PROMPTS, MAX_TOKENS))


def test_mxfp4_experts_stay_four_bit_with_the_checkpoints_codes(mxfp4):
    """Loaded from the file, each layer's experts are the checkpoint's own blocks and exponents (gate rows, then up
    rows, as strata holds an MXFP4 checkpoint's), uint8, with no float copy beside them."""
    from strata.distributed import ParallelContext
    from strata.executor.model_runner import ModelRunner

    hf, path = mxfp4
    stored = load_file(str(hf / "model.safetensors"))
    runner = ModelRunner(EngineConfig.create(str(path), dtype="float32", device="cpu"), ParallelContext(),
                         torch.device("cpu"))
    for i, layer in enumerate(runner.model.model.layers):
        experts = layer.mlp.experts
        assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
        for name in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
            want = stored[f"model.layers.{i}.mlp.experts.{name}"]
            if name.startswith("gate_up"):
                want = torch.cat((want[:, 0::2], want[:, 1::2]), dim=1)
            got = getattr(experts, name)
            assert got.dtype == torch.uint8 and torch.equal(got, want), name


def test_float_experts_file_gives_transformers_tokens_of_the_checkpoint(tmp_path):
    """A float checkpoint converts to F32 experts (gate and up as separate tensors, transposed): loaded as float."""
    from transformers import AutoModelForCausalLM

    hf = make_gpt_oss(tmp_path / "hf", seed=3, **SHAPE)
    path = convert(hf, tmp_path / "gpt_oss-f32.gguf")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert_matches_transformers(strata_greedy(path, PROMPTS[:2], MAX_TOKENS),
                                transformers_outputs(model, PROMPTS[:2], MAX_TOKENS))


def test_config_follows_the_checkpoint_and_unread_metadata_is_refused_by_name(mxfp4):
    hf, path = mxfp4
    gguf = GGUFModel([path])
    config = hf_config(gguf)
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False}
    gguf.metadata["gpt-oss.expert_weights_scale"] = 2.0
    with pytest.raises(UnsupportedModelError, match=r"gpt-oss\.expert_weights_scale"):
        hf_config(gguf)
    gguf.metadata.pop("gpt-oss.expert_weights_scale")
    gguf.metadata["gpt-oss.rope.scaling.type"] = "longrope"
    with pytest.raises(UnsupportedModelError, match="longrope"):
        hf_config(gguf)


def test_tensor_parallel_size_that_cuts_an_mxfp4_block_is_refused(mxfp4):
    with pytest.raises(ConfigError, match="MXFP4 block of 32"):
        EngineConfig.create(str(mxfp4[1]), tensor_parallel_size=4, dtype="float32", device="cpu")


@pytest.mark.slow
def test_tp2_pp2_give_the_tokens_of_one_process(mxfp4):
    """Four ranks: heads, sinks and the MXFP4 experts' intermediate width (one block a rank) split by TP=2, layers
    by PP=2."""
    path = mxfp4[1]
    one = [o.outputs[0].token_ids for o in strata_greedy(path, PROMPTS, MAX_TOKENS)]
    split = strata_greedy(path, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [o.outputs[0].token_ids for o in split] == one


def test_int8_activations_run_the_mxfp4_experts_on_q8_0_rows_near_the_float_logprobs(mxfp4):
    """quantized_activations=int8 on the file converted with its matrices in Q8_0 (the experts stay MXFP4, the
    router F32 in float as llama.cpp keeps it): the experts multiply x rounded to Q8_0 in integers, each step's rows
    rounded once for all a layer's experts, and the first token's logprobs stay within rounding of the float path."""
    from strata import LLM, SamplingParams
    from strata.kernels.cpu import matmul as cpu_matmul
    from strata.layers.moe import FusedMoE

    path = convert(mxfp4[0], mxfp4[1].parent / "gpt_oss-q8_0.gguf", "q8_0")
    params, prompts = SamplingParams(temperature=0, max_tokens=1, logprobs=5), [{"prompt_token_ids": list(p)}
                                                                             for p in PROMPTS]
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
    tokens = sum(len(p) for p in PROMPTS)  # one prefill step: a layer's rows once (down rounds each expert's input)
    assert rounded.count(tokens) == len(experts)
    differences = []
    for a, b in zip(exact, int8, strict=True):
        want, got = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        differences += [abs(want[t].logprob - got[t].logprob) for t in want.keys() & got.keys()]
    assert len(differences) >= 3 * len(PROMPTS) and 0 < max(differences) < 0.25

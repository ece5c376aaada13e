"""Whole GGUF models against transformers' own GGUF loader: logits, greedy tokens and logprobs for every ggml type,
a tied Q8_0 table looked up row by row and serving as the LM head, TP x PP layouts, and what `strata plan` counts."""
from __future__ import annotations

import pytest
import torch
from arch_checkpoints import make_arch
from checkpoints import make_llama
from gguf_checkpoints import Q4_1, Q8_0, types_by_prefix, write_gguf
from model_forward import strata_logits
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.gguf.reader import GGUFModel
from strata.plan import plan_layout

PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over", "import os\nimport sys",
           "Paged attention stores keys and values in fixed size blocks."]


def transformers_model(path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def reference_greedy(model, prompt_ids: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_every_ggml_type_gives_transformers_logits_and_greedy_tokens(gguf_all_types):
    reference = transformers_model(gguf_all_types)
    tokenizer = AutoTokenizer.from_pretrained(gguf_all_types.parent, gguf_file=gguf_all_types.name)
    ids = tokenizer(PROMPTS[0]).input_ids
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    got = strata_logits(gguf_all_types, ids)
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()

    with LLM(str(gguf_all_types), device="cpu") as llm:
        assert llm.get_tokenizer()(PROMPTS[1]).input_ids == tokenizer(PROMPTS[1]).input_ids
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert tokens == reference_greedy(reference, out.prompt_token_ids, 24)
        with torch.no_grad():  # the sampled token's logprob, from transformers' logits of the whole text
            logits = reference(torch.tensor([out.prompt_token_ids + tokens])).logits[0].log_softmax(-1)
        start = len(out.prompt_token_ids) - 1
        for i, (token, lp) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - logits[start + i, token].item()) < 1e-4


def test_tied_q8_0_table_is_looked_up_by_row_and_is_the_lm_head(gguf_tied_q4_1):
    reference = transformers_model(gguf_tied_q4_1)
    with LLM(str(gguf_tied_q4_1), device="cpu") as llm:
        runner = llm.engine.executor.runner
        model = runner.model
        assert model.lm_head.quant is model.model.embed_tokens.quant  # one table, in its blocks
        file_bytes = sum(e.nbytes for e in GGUFModel([gguf_tied_q4_1]).tensors.values())
        assert runner.weight_bytes == file_bytes  # nothing dequantized beside the blocks
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == reference_greedy(reference, out.prompt_token_ids, 24)


def test_tp2_pp2_gives_the_tokens_of_one_process(gguf_tied_q4_1):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(gguf_tied_q4_1), device="cpu") as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(gguf_tied_q4_1), device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected


def test_plan_counts_the_stored_blocks_of_each_rank(gguf_tied_q4_1):
    file_bytes = sum(e.nbytes for e in GGUFModel([gguf_tied_q4_1]).tensors.values())
    [single] = plan_layout(EngineConfig.create(str(gguf_tied_q4_1), device="cpu"))
    assert single.param_bytes == file_bytes
    ranks = plan_layout(EngineConfig.create(str(gguf_tied_q4_1), device="cpu", tensor_parallel_size=2))
    # Each rank holds half of every matrix (the tied table once); the F32 norms are replicated.
    norms = sum(e.nbytes for e in GGUFModel([gguf_tied_q4_1]).tensors.values() if len(e.shape) == 1)
    assert [r.param_bytes for r in ranks] == [(file_bytes - norms) // 2 + norms] * 2


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_files_give_transformers_tokens(arch, tmp_path):
    """Qwen files (q/k/v biases, Qwen3's per-head q/k norms, rows not permuted) against transformers, which loads
    the file's weights into the checkpoint's own config (its GGUF path would not read Qwen3's head_dim)."""
    extra = {"head_dim": 32} if arch == "qwen3" else {"use_sliding_window": False}
    hf = make_arch(tmp_path / "hf", arch, hidden_size=128, intermediate_size=256, **extra)
    path = write_gguf(hf, tmp_path / f"{arch}.gguf", types_by_prefix({"blk.1": Q4_1}, Q8_0), arch=arch)[0]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                     config=AutoConfig.from_pretrained(hf))
    with LLM(str(path), device="cpu") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == reference_greedy(reference, out.prompt_token_ids, 16)


def test_llama3_rotary_scaling_from_rope_freqs_gives_transformers_tokens(tmp_path):
    """Llama 3.1's rotary scaling reaches a GGUF file as a tensor of frequency divisors (rope_freqs), as
    llama.cpp's converter writes it: the file must give the tokens transformers gives the checkpoint it came from
    (a short original context, so most frequencies are scaled at these lengths)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = make_llama(tmp_path / "hf", hidden_size=128, intermediate_size=256, rope_scaling=scaling, seed=5)
    path = write_gguf(hf, tmp_path / "llama31.gguf", types_by_prefix({}, Q8_0))[0]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                     config=AutoConfig.from_pretrained(hf))
    assert GGUFModel([path]).tensors.keys() >= {"rope_freqs.weight"}
    with LLM(str(path), device="cpu") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == reference_greedy(reference, out.prompt_token_ids, 48)

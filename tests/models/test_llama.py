"""Llama against Hugging Face transformers: logits of one forward pass and greedy generation."""
from __future__ import annotations

import pytest
import torch
from model_forward import strata_logits
from transformers import AutoModelForCausalLM, AutoTokenizer

from strata import LLM, SamplingParams

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "import os",
    "Once upon a time there was",
    "class Engine:\n    def step(self):",
    "Paged attention stores keys and values in fixed size blocks. Paged attention stores",
]


@pytest.mark.parametrize("fixture", ["llama_gqa", "llama_tied"])
def test_logits_of_one_forward_pass_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        got = strata_logits(path, ids)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("fixture", ["llama_gqa", "llama_tied"])
def test_greedy_generation_matches_transformers_token_for_token(fixture, request):
    path = request.getfixturevalue(fixture)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(str(path), dtype="float32", device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():  # no EOS for transformers either: both run the full 32 tokens
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=1)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist()
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)

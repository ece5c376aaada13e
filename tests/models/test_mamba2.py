"""Mamba2 against transformers' torch implementation: logits of one forward pass, greedy generation, and
TP / PP layouts against one process."""
from __future__ import annotations

import pytest
import torch
from mamba_checkpoints import StepRunner, make_mamba2, one_torch_thread  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM

from strata import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_LENGTHS = (1, 7, 37)


def random_prompt(length: int, seed: int, vocab: int = 260) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def mamba2_one_group(tmp_path_factory):
    """One B/C group (replicated under TP), untied head, vocabulary 300."""
    return make_mamba2(tmp_path_factory.mktemp("mamba2_g1"), n_groups=1, seed=3)


@pytest.fixture(scope="module")
def mamba2_two_groups(tmp_path_factory):
    """Two B/C groups (split under TP=2), tied head."""
    return make_mamba2(tmp_path_factory.mktemp("mamba2_g2"), n_groups=2, tied=True, num_layers=2, seed=4)


@pytest.mark.parametrize("fixture", ["mamba2_one_group", "mamba2_two_groups"])
def test_logits_of_one_forward_pass_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    runner = StepRunner(path)
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = random_prompt(length, i)
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        (got,) = runner.step([(f"r{i}", ids, 0)])
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("fixture", ["mamba2_one_group", "mamba2_two_groups"])
def test_greedy_generation_matches_transformers_token_for_token(fixture, request):
    path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [random_prompt(n, 10 + n) for n in (3, 12, 30)]
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def generate_both(path, **layout) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [{"prompt_token_ids": random_prompt(n, 20 + n)} for n in (4, 19, 33)]
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=8, **layout) as llm:
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        seeded = llm.generate(prompts, SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                              use_tqdm=False)
    return [o.outputs[0].token_ids for o in greedy], [o.outputs[0].token_ids for o in seeded]


@pytest.mark.slow
@pytest.mark.parametrize(("fixture", "layout"), [
    ("mamba2_one_group", {"tensor_parallel_size": 2}),  # the gated norm spans both ranks
    ("mamba2_two_groups", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    ("mamba2_one_group", {"pipeline_parallel_size": 2}),
])
def test_parallel_layouts_generate_the_tokens_of_one_process(fixture, layout, request):
    path = request.getfixturevalue(fixture)
    greedy, seeded = generate_both(path, **layout)
    expected_greedy, expected_seeded = generate_both(path)
    assert greedy == expected_greedy
    if layout.get("tensor_parallel_size", 1) == 1:  # TP sums partial products in another order
        assert seeded == expected_seeded

"""Speculative decoding in the engine: with n-gram or suffix drafts, every request gets exactly the tokens (and
logprobs) it gets without them, greedy or seeded, through chunked prefill, preemption, mixed batches, stops inside a
draft, n > 1, grammars and the prefix cache; and drafts are accepted (the speculation is not idle)."""
from __future__ import annotations

import pytest

from strata import LLM, SamplingParams
from strata.config import EngineConfig
from strata.errors import ConfigError
from strata.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
# Repetitive prompts: the tiny random model soon repeats itself too, so drafts are often right.
PROMPTS = [{"prompt_token_ids": ([5, 6, 7, 8, 9, 10, 11] * 12)[:18 + 9 * i]} for i in range(5)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(llama_gqa):
    return LLM(str(llama_gqa), max_model_len=256)


@pytest.fixture(scope="module", params=[NGRAM, SUFFIX], ids=["ngram", "suffix"])
def spec(request, llama_gqa):
    # A small step budget: the longer prompts are prefilled in chunks while the shorter ones already decode with
    # drafts in the same steps.
    return LLM(str(llama_gqa), max_model_len=256, max_num_batched_tokens=40, speculative_config=request.param)


def test_greedy_output_is_the_same_with_drafts_and_drafts_are_accepted(plain, spec):
    params = [SamplingParams(temperature=0, max_tokens=30 + 5 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    before = spec.engine.spec.stats.copy()
    assert tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == tokens(plain.generate(PROMPTS, params,
                                                                                             use_tqdm=False))
    stats = spec.engine.spec.stats.since(before)
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > stats.num_drafts
    assert stats.mean_acceptance_length > 1.5


def test_seeded_sampling_penalties_min_tokens_and_logprobs_are_the_same_with_drafts(plain, spec):
    params = [SamplingParams(temperature=0.7, top_k=30, top_p=0.95, seed=i, max_tokens=25, min_tokens=10,
                             presence_penalty=0.3 * (i % 2), repetition_penalty=1.0 + 0.1 * (i % 3), logprobs=2,
                             stop_token_ids=[1]) for i in range(len(PROMPTS))]
    got, want = spec.generate(PROMPTS, params, use_tqdm=False), plain.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want, strict=True):
        # The target's logprobs; a verification step computes them in a batch of positions, hence the tolerance.
        for g_pos, w_pos in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert list(g_pos) == list(w_pos)
            assert [lp.logprob for lp in g_pos.values()] == pytest.approx([lp.logprob for lp in w_pos.values()],
                                                                          abs=1e-3)


def test_stop_tokens_and_strings_inside_a_draft_end_the_output_there(plain, spec):
    prompt = PROMPTS[2]
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    ids, text = full.outputs[0].token_ids, full.outputs[0].text
    for params in (SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[17]]),
                   SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 2:len(text) // 2 + 3]]),
                   SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)):
        got, want = spec.generate(prompt, params, use_tqdm=False)[0], plain.generate(prompt, params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert (got.outputs[0].text, got.outputs[0].finish_reason, got.outputs[0].stop_reason) == \
               (want.outputs[0].text, want.outputs[0].finish_reason, want.outputs[0].stop_reason)


def test_n_samples_and_a_grammar_behave_as_without_drafts(plain, spec):
    params = SamplingParams(n=3, temperature=0.8, seed=4, max_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs] == \
           [o.token_ids for o in plain.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs]
    regex = StructuredOutputsParams(regex=r"(ab|cd)+ [a-z]{3,12}\.")
    constrained = SamplingParams(temperature=0, max_tokens=30, structured_outputs=regex)
    got = spec.generate(PROMPTS[0], constrained, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == plain.generate(PROMPTS[0], constrained, use_tqdm=False)[0].outputs[0].token_ids


def test_rejected_drafts_never_reach_the_prefix_cache(llama_gqa, plain):
    """A second request reuses the cached blocks of a first one's output: had a rejected draft's KV been cached,
    its greedy output would differ from a cold run's."""
    llm = LLM(str(llama_gqa), max_model_len=256, block_size=4, speculative_config=NGRAM)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0]
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected
    follow_up = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids[:33]}
    second = llm.generate(follow_up, greedy, use_tqdm=False)[0]
    assert second.num_cached_tokens >= len(first.prompt_token_ids) + 28
    assert second.outputs[0].token_ids == plain.generate(follow_up, greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_preempted_requests_with_drafts_finish_with_the_same_tokens(llama_gqa, plain):
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block size x KV heads x head size x float32
    llm = LLM(str(llama_gqa), max_model_len=128, kv_cache_memory=10 * block_bytes, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == tokens(plain.generate(PROMPTS, params,
                                                                                           use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0


def test_drafts_stop_when_the_decodes_alone_fill_the_step_budget(llama_gqa):
    llm = LLM(str(llama_gqa), max_model_len=256, speculative_config={**NGRAM, "max_step_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate(PROMPTS[:4], params, use_tqdm=False)  # four decodes fill a step of four tokens
    assert llm.engine.spec.stats.num_drafts == 0
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert llm.engine.spec.stats.num_drafts > 0


def test_speculation_is_refused_for_models_whose_state_cannot_roll_back(tmp_path):
    from mamba_checkpoints import make_mamba2

    path = make_mamba2(tmp_path / "mamba2")
    with pytest.raises(ConfigError, match="cannot be rolled back") as refused:
        EngineConfig.create(str(path), speculative_config=NGRAM)
    assert refused.value.param == "speculative_config"


def test_a_draft_model_gives_the_same_tokens_and_a_copy_of_the_target_drafts_them_all(llama_gqa, plain):
    llm = LLM(str(llama_gqa), max_model_len=256, speculative_config={"model": str(llama_gqa),
                                                                      "num_speculative_tokens": 3})
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[:3], greedy, use_tqdm=False)) == tokens(plain.generate(PROMPTS[:3], greedy,
                                                                                              use_tqdm=False))
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 5 and stats.acceptance_rate == 1.0  # its own greedy tokens
    seeded = [SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(3)]
    assert tokens(llm.generate(PROMPTS[:3], seeded, use_tqdm=False)) == tokens(plain.generate(PROMPTS[:3], seeded,
                                                                                              use_tqdm=False))


def test_a_draft_models_catch_up_on_verified_tokens_runs_as_decode_rows(llama_gqa, plain, monkeypatch):
    """After a verification the draft feeds its last draft token and the bonus token (more after a rejection): those
    few tokens are decode rows of the draft's step (its decode kernels), not a prefill chunk, and change nothing."""
    from strata.executor import model_runner

    steps = []  # per step with a catch-up: (requests, tokens, decode rows)
    real = model_runner.prepare_step

    def spy(requests, *args, **kwargs):
        input_ids, positions, meta = real(requests, *args, **kwargs)
        if any(s.catch_up for s in requests):
            steps.append((len(requests), len(input_ids), meta.attn.num_decodes))
        return input_ids, positions, meta

    monkeypatch.setattr(model_runner, "prepare_step", spy)
    llm = LLM(str(llama_gqa), max_model_len=256, speculative_config={"model": str(llama_gqa),
                                                                      "num_speculative_tokens": 3})
    # Greedy: a copy of the target has every draft accepted (a 2-token catch-up each time); seeded: rejections.
    for params in [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   *[SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(2)]]:
        assert tokens(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == \
            tokens(plain.generate(PROMPTS[:2], params, use_tqdm=False))
    assert any(n > requests for requests, n, _ in steps) and all(n == rows for _, n, rows in steps)


def test_a_draft_model_with_another_vocabulary_is_refused(llama_gqa, tmp_path):
    from checkpoints import make_llama

    other = make_llama(tmp_path / "other_vocab", vocab_size=300, num_layers=1)
    with pytest.raises(ConfigError, match="does not share the target's tokenizer") as refused:
        LLM(str(llama_gqa), speculative_config={"model": str(other), "num_speculative_tokens": 2})
    assert refused.value.param == "speculative_config.model"


def test_a_thinking_request_under_a_grammar_drafts_its_thinking_and_answers_as_without_drafts(thinking_llama):
    """Drafts stop before the end of the thinking (the grammar starts after it), and the answer is masked."""
    msgs = [{"role": "user", "content": "<think> quick brown fox</think> quick brown fox</think>"}]
    params = SamplingParams(temperature=0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex="(yes|no)!"))
    want = LLM(str(thinking_llama), reasoning_parser="qwen3").chat(msgs, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(thinking_llama), reasoning_parser="qwen3", speculative_config=NGRAM)
    got = llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text.endswith("</think>no!")
    assert llm.engine.spec.stats.num_accepted_tokens >= 3  # " quick brown fox" came from a draft


def test_harmony_drafts_stop_before_the_final_header_completes(harmony_gpt_oss):
    """gpt-oss's thinking ends with a header of three tokens (`<|channel|>final<|message|>`): a draft that would
    complete it is cut there, so the grammar masks every row after it, and the output is that without drafts."""
    header = "<|end|><|start|>assistant<|channel|>final<|message|>"
    # Without " fox", which would tell the model its thinking is done; the n-grams of the header are there.
    msgs = [{"role": "user", "content": f"<|channel|>analysis<|message|> quick brown{header} It is sunny."}]
    params = SamplingParams(temperature=0, max_tokens=30, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(regex="(yes|no)!"))
    want = LLM(str(harmony_gpt_oss), reasoning_parser="openai_gptoss").chat(msgs, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(harmony_gpt_oss), reasoning_parser="openai_gptoss", speculative_config=NGRAM)
    got = llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text.endswith(f"{header}no!")
    assert llm.engine.spec.stats.num_accepted_tokens >= 3

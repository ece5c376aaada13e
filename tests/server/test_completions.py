"""/v1/completions through the official openai client against a real `strata serve` (spec table B3)."""
from __future__ import annotations

import openai
import pytest
from conftest import ALIAS, MAX_MODEL_LEN, MODEL

PROMPT = "Hello, my name is"
IDS = [45, 46, 47, 48, 49]
# Many stop ids make seeded samples end at different lengths, as a trained model's EOS would.
MANY_STOPS = list(range(100, 160))


def test_greedy_completion_has_id_length_finish_and_usage(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    prompt_len = len(tokenizer(PROMPT).input_ids)  # string prompts get the BOS, like vLLM
    assert (out.usage.completion_tokens, out.usage.prompt_tokens, out.usage.total_tokens) == (5, prompt_len,
                                                                                              prompt_len + 5)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompt_is_sent_as_is_without_bos(client):
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.usage.prompt_tokens == len(IDS)
    assert out.choices[0].prompt_token_ids == IDS
    assert len(out.choices[0].token_ids) == 3
    assert out.choices[0].prompt_logprobs is None


def test_text_and_token_id_prompts_give_the_same_greedy_text(client, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text


@pytest.mark.parametrize("side,expected", [("right", [0, 1, 2, 3]), ("left", [4, 5, 6, 7])])
def test_truncate_prompt_tokens_keeps_the_chosen_side(client, side, expected):
    out = client.completions.create(model=MODEL, prompt=list(range(8)), max_tokens=1, extra_body={
        "return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side})
    assert out.choices[0].prompt_token_ids == expected


def test_no_logprobs_unless_asked(client):
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=3, temperature=0)
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_hold_top_k_plus_the_chosen_token(client, k):
    # Token ids as names: partial UTF-8 tokens of a byte-level vocabulary all decode to the same text.
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=4, temperature=0, logprobs=k,
                                    extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(k, 1) <= len(top) <= k + 1
        assert top[token] == pytest.approx(token_lp)
        assert token_lp <= 0
        if k:  # greedy: the chosen token is the most likely one
            assert token_lp == pytest.approx(max(top.values()))
    assert lp.tokens == [f"token_id:{t}" for t in out.choices[0].token_ids]


def test_text_offsets_add_up_the_token_texts(client):
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=6, temperature=0, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_logprobs_above_20_are_refused_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt=IDS, max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        stream = client.completions.create(model=MODEL, prompt=IDS, max_tokens=2, logprobs=30, stream=True)
        list(stream)
    assert client.completions.create(model=MODEL, prompt=IDS, max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("k", [0, 1, None])
def test_prompt_logprobs_for_each_prompt_of_a_batch(client, k):
    extra = {} if k is None else {"prompt_logprobs": k}
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "The quick brown fox"], max_tokens=2,
                                    temperature=0, extra_body=extra)
    for choice in out.choices:
        if k is None:
            assert choice.prompt_logprobs is None
            continue
        assert choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) > 2
        for position in choice.prompt_logprobs[1:]:
            assert 1 <= len(position) <= k + 1


def test_negative_prompt_logprobs_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": -1})


def test_streamed_text_equals_the_non_streamed_text(client):
    full = client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=12, temperature=0,
                                            stream=True))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason is not None]
    assert finishes == ["length"] and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def _n_samples(client, stream: bool):
    return client.completions.create(model=MODEL, prompt=PROMPT, n=3, temperature=1.0, max_tokens=50, logprobs=0,
                                     seed=42, stream=stream, extra_body={"stop_token_ids": MANY_STOPS})


def test_n_seeded_samples_differ_and_end_at_different_lengths(client):
    out = _n_samples(client, stream=False)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason is not None for c in out.choices)
    assert len({c.text for c in out.choices}) == 3
    assert len({len(c.logprobs.tokens) for c in out.choices}) > 1
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    again = _n_samples(client, stream=False)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_n_streamed_samples_rebuild_to_the_non_streamed_ones(client):
    texts, chunks_per, finishes = ["", "", ""], [0, 0, 0], [0, 0, 0]
    for chunk in _n_samples(client, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        chunks_per[choice.index] += 1
        finishes[choice.index] += choice.finish_reason is not None
    assert finishes == [1, 1, 1] and max(chunks_per) <= 50
    assert texts == [c.text for c in _n_samples(client, stream=False).choices]


@pytest.mark.parametrize("include,continuous", [(False, False), (False, True), (True, False), (True, True)])
def test_stream_options_control_usage_chunks(client, include, continuous):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": include, "continuous_usage_stats": continuous}))
    if not include:
        assert all(c.usage is None for c in chunks)
        return
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5 and last.usage.prompt_tokens > 0
    for c in body:
        if continuous:
            assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        else:
            assert c.usage is None


def test_empty_stream_options_give_no_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                            stream_options={}))
    assert all(c.usage is None for c in chunks)


@pytest.mark.parametrize("options", [{"include_usage": True}, {"continuous_usage_stats": True},
                                     {"include_usage": None}])
def test_stream_options_without_stream_are_refused(client, options):
    with pytest.raises(openai.BadRequestError, match="stream=True"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=False, stream_options=options)


@pytest.mark.parametrize("prompt", [[PROMPT, PROMPT], [IDS, IDS]])
def test_batched_prompts_give_one_choice_each(client, prompt):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True):
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [out.choices[0].text] * 2


def test_batch_with_n_numbers_choices_prompt_major(client):
    out = client.completions.create(model=MODEL, prompt=[IDS, [50, 51, 52]], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text and out.choices[2].text == out.choices[3].text


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("prompt", [PROMPT, IDS])
def test_echo_returns_the_prompt_with_one_logprob_per_token(client, tokenizer, k, prompt):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=k,
                                    extra_body={"return_tokens_as_token_ids": True})
    choice = choice_lp = out.choices[0]
    prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
    assert choice.text.startswith(prompt_text)
    num_prompt = out.usage.prompt_tokens
    lp = choice_lp.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for top in lp.top_logprobs[1:]:
        assert max(k, 1) <= len(top) <= k + 1


def test_streamed_echo_with_logprobs_rebuilds_the_non_streamed_choice(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1)
    full = client.completions.create(**kwargs).choices[0]
    text, tokens, token_lps, offsets = "", [], [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        text += choice.text
        tokens += choice.logprobs.tokens
        token_lps += choice.logprobs.token_logprobs
        offsets += choice.logprobs.text_offset
    assert text == full.text and tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    assert token_lps == pytest.approx(full.logprobs.token_logprobs)


def test_echo_with_zero_max_tokens_returns_only_the_prompt(client):
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    assert out.usage.completion_tokens == 0
    assert len(lp.token_logprobs) == len(IDS) and lp.token_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])


def test_max_tokens_defaults_to_16(client):
    out = client.completions.create(model=MODEL, prompt=IDS, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16


def test_max_tokens_is_clamped_to_the_context(client):
    prompt = [50 + i % 300 for i in range(MAX_MODEL_LEN - 4)]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"


def _greedy(client, prompt, n_tokens, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True, **extra}).choices[0]


def test_stop_string_ends_the_text_before_it(client):
    full = _greedy(client, PROMPT, 24).text
    at = next(i for i in range(1, len(full)) if full.find(full[i]) == i and full[i] != "\ufffd")
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[full[at]],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[:at]
    assert out.choices[0].finish_reason == "stop"
    kept = _greedy(client, PROMPT, 24, stop=[full[at]], include_stop_str_in_output=True)
    assert kept.text == full[:at + 1]


def test_stop_token_id_ends_generation_and_is_reported(client):
    tokens = _greedy(client, PROMPT, 12).token_ids
    stop_at = next(i for i in range(2, len(tokens)) if tokens.index(tokens[i]) == i)
    out = _greedy(client, PROMPT, 12, stop_token_ids=[tokens[stop_at]])
    assert out.token_ids == tokens[:stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[stop_at]


def test_seeded_sampling_repeats_and_another_seed_differs(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(33) == sample(33)
    assert sample(33) != sample(34)


def test_min_tokens_and_ignore_eos_set_the_length(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=1,
                                    extra_body={"min_tokens": 12, "stop_token_ids": MANY_STOPS})
    assert out.usage.completion_tokens >= 12
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 40


def test_vllm_sampling_extras_are_accepted(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, top_p=0.9, presence_penalty=0.5,
                                    frequency_penalty=0.5, seed=3, extra_body={
                                        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2})
    assert out.usage.completion_tokens <= 5


def test_best_of_above_n_is_refused_clearly(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, best_of=3)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, best_of=1).choices


def test_models_lists_every_served_name_and_each_answers(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    assert models.data[0].root == str(server.checkpoint)
    out = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2)
    assert out.model == ALIAS

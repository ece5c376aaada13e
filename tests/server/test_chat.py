"""/v1/chat/completions through the official openai client against a real `strata serve` (spec table B4)."""
from __future__ import annotations

import httpx
import openai
import pytest
from conftest import MODEL

MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]


def _chat(client, messages=MESSAGES, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_single_turn_reports_role_finish_and_usage(client, http):
    out = _chat(client, max_completion_tokens=5, logprobs=True, top_logprobs=5)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt_len = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert (out.usage.completion_tokens, out.usage.prompt_tokens, out.usage.total_tokens) == (
        5, prompt_len, prompt_len + 5)
    assert len(choice.logprobs.content) == 5


def test_multi_turn_follow_up_works(client):
    first = _chat(client, max_completion_tokens=5)
    follow = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "and 2+2?"}]
    out = _chat(client, messages=follow, max_completion_tokens=5)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 5


def test_no_logprobs_unless_asked(client):
    assert _chat(client, max_tokens=3, logprobs=False).choices[0].logprobs is None


@pytest.mark.parametrize("k", [0, 5])
def test_top_logprobs_gives_exactly_k_alternatives(client, k):
    out = _chat(client, max_tokens=4, logprobs=True, top_logprobs=k, extra_body={"return_tokens_as_token_ids": True})
    for entry in out.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == k
        assert entry.logprob <= 0
        if k:  # greedy: the chosen token is the best alternative
            assert entry.token == entry.top_logprobs[0].token


def test_top_logprobs_above_20_are_refused_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        _chat(client, max_tokens=3, logprobs=True, top_logprobs=30)
    with pytest.raises(openai.BadRequestError):
        list(_chat(client, max_tokens=3, logprobs=True, top_logprobs=21, stream=True))
    assert _chat(client, max_tokens=3).choices[0].message.content is not None


@pytest.mark.parametrize("k", [0, 1, 2, None])
def test_prompt_logprobs_cover_the_conversation(client, k):
    messages = [*MESSAGES, {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 3+3?"}]
    out = _chat(client, messages=messages, max_tokens=2, extra_body={} if k is None else {"prompt_logprobs": k})
    if k is None:
        assert out.prompt_logprobs is None
        return
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == out.usage.prompt_tokens
    assert all(1 <= len(p) <= k + 1 for p in out.prompt_logprobs[1:])


def test_streamed_content_equals_the_non_streamed_content(client):
    full = _chat(client, max_tokens=10)
    chunks = list(_chat(client, max_tokens=10, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_usage_only_in_a_final_empty_chunk(client):
    chunks = list(_chat(client, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in _chat(client, max_tokens=3, stream=True,
                                              stream_options={"include_usage": False}))


def test_continuous_usage_counts_up_to_min_tokens(client):
    chunks = list(_chat(client, max_tokens=10, temperature=1.0, seed=5, stream=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True},
                        extra_body={"min_tokens": 10}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(b > a for a, b in zip(counts[:-2], counts[1:-1], strict=True))
    assert counts[-1] == counts[-2] == 10


def test_stream_options_without_stream_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="stream=True"):
        _chat(client, max_tokens=3, stream_options={"include_usage": True})


def test_text_parts_give_the_same_output_as_plain_content(client):
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    assert _chat(client, messages=parts, max_tokens=6).choices[0].message.content == \
        _chat(client, max_tokens=6).choices[0].message.content


def test_custom_roles_and_unknown_message_fields_are_accepted(client):
    messages = [{"role": "narrator", "content": "hi", "x_extra": 1}, {"role": "user", "content": "hello"}]
    assert _chat(client, messages=messages, max_tokens=2).choices[0].finish_reason is not None


def test_image_parts_are_refused_for_a_text_only_model(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    with pytest.raises(openai.BadRequestError, match="text-only"):
        _chat(client, messages=messages, max_tokens=2)


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_seed_outside_int64_is_refused_with_pydantic_wording(client, seed):
    with pytest.raises(openai.BadRequestError, match="greater_than_equal|less_than_equal"):
        _chat(client, max_tokens=2, seed=seed)


def test_n_samples_differ(client):
    out = _chat(client, max_tokens=8, n=3, temperature=0.7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content for c in out.choices) and len({c.message.content for c in out.choices}) > 1
    seeded = _chat(client, max_tokens=8, n=2, temperature=1.0, seed=42)
    assert len(seeded.choices) == 2 and len(_chat(client, max_tokens=2, n=1).choices) == 1


def test_n_streamed_samples_both_receive_content(client):
    texts = ["", ""]
    for chunk in _chat(client, max_tokens=8, n=2, temperature=1.0, seed=3, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts)


def test_stop_and_seed_apply_to_chat(client):
    full = _chat(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
    at = next(i for i in range(1, len(full)) if full.find(full[i]) == i and full[i] != "\ufffd")
    out = _chat(client, max_tokens=16, stop=full[at], extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == full[:at] and out.choices[0].finish_reason == "stop"
    first = _chat(client, max_tokens=8, temperature=1.0, seed=11).choices[0].message.content
    assert _chat(client, max_tokens=8, temperature=1.0, seed=11).choices[0].message.content == first


def test_max_tokens_is_the_old_name_of_max_completion_tokens(client):
    assert _chat(client, max_tokens=3, extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    assert _chat(client, max_completion_tokens=4, extra_body={"ignore_eos": True}).usage.completion_tokens == 4


def test_invocations_answers_like_chat_completions(server, http):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    chat = http.post("/v1/chat/completions", json=body).json()
    sagemaker = http.post("/invocations", json=body).json()
    assert sagemaker.keys() == chat.keys() and sagemaker["choices"] == chat["choices"]
    assert httpx.post(f"{server.url}/invocations", json=body).status_code == 401

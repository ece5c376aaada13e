"""The offline API: outputs, stop conditions, n > 1, logprobs, prompt logprobs, chat, bad input."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata import LLM, RequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_gqa):
    return LLM(str(llama_gqa), max_model_len=256)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_stop_string_is_cut_from_the_text(llm):
    full = llm.generate("def add", greedy(max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    out = llm.generate("def add", greedy(max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    kept = llm.generate("def add", greedy(max_tokens=20, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.find(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate("import", greedy(max_tokens=12), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate("import", greedy(max_tokens=12, stop_token_ids=[full[3]]), use_tqdm=False)[0].outputs[0]
    first = full.index(full[3])
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop" and out.stop_reason == full[3]
    held = llm.generate("import", greedy(max_tokens=12, stop_token_ids=[full[0]], min_tokens=4),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 4 and full[0] not in held.token_ids[:3]


def test_eos_ends_generation_unless_ignored(llm):
    eos = llm.get_tokenizer().eos_token_id
    p = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[], logprobs=None)
    out = llm.generate({"prompt_token_ids": [0, 5, 6]}, p, use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:-1]
    assert out.finish_reason == ("stop" if out.token_ids[-1] == eos else "length")


def test_max_tokens_is_capped_by_the_context_length(llama_gqa):
    small = LLM(str(llama_gqa), max_model_len=20)
    out = small.generate({"prompt_token_ids": list(range(2, 17))}, greedy(max_tokens=100), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_n_samples_are_independent_and_seeded(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    a = llm.generate("hello", p, use_tqdm=False)[0]
    b = llm.generate("hello", p, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_logprobs_hold_the_sampled_token_and_top_k(llm):
    out = llm.generate("def", greedy(max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        assert token in position and position[token].rank == 1
        assert len(position) == 3
        values = [lp.logprob for lp in position.values()]
        assert values == sorted(values, reverse=True)
    assert abs(out.cumulative_logprob - sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs,
                                                                         strict=True))) < 1e-4


def test_prompt_logprobs_match_transformers(llm, llama_gqa):
    ids = llm.get_tokenizer()("The quick brown fox jumps").input_ids
    out = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_gqa, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1


def test_prompt_logprobs_survive_chunked_prefill(llama_gqa, llm):
    ids = llm.get_tokenizer()("Paged attention stores keys and values in blocks").input_ids
    p = greedy(max_tokens=1, prompt_logprobs=0)
    whole = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].prompt_logprobs
    chunked = LLM(str(llama_gqa), max_num_batched_tokens=3).generate({"prompt_token_ids": ids}, p,
                                                                     use_tqdm=False)[0].prompt_logprobs
    for a, b in zip(whole[1:], chunked[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[k].logprob - b[k].logprob) < 1e-5 for k in a)


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, greedy(max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == llm.get_tokenizer()(expected, add_special_tokens=False).input_ids
    assert len(llm.chat([messages, messages], greedy(max_tokens=2), use_tqdm=False)) == 2


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": list(range(2, 300))}, "maximum context length is 256 tokens.*298"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [5, 100000]}, "outside the vocabulary"),
    (3.5, "prompt must be"),
])
def test_bad_prompts_raise_request_errors_and_leave_the_engine_usable(llm, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm.generate(prompt, greedy(max_tokens=2), use_tqdm=False)
    assert llm.generate("ok", greedy(max_tokens=2), use_tqdm=False)[0].finished

"""Offline generation on a checkpoint that thinks: a grammar constrains the answer after the thinking (with a
reasoning parser), chat template keywords reach the template, and the token that ends an output is not its text."""
from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from strata import LLM, SamplingParams, StructuredOutputsParams

THOUGHT = "<think> quick brown fox</think>"  # what the checkpoint's weights make it say first
ANSWER = r"The answer is [0-9]\."
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(thinking_llama):
    with LLM(str(thinking_llama), max_model_len=256, kv_cache_memory=4 << 20, reasoning_parser="qwen3") as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer(thinking_llama):
    return AutoTokenizer.from_pretrained(thinking_llama)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, **kw)


def constrained(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=5, max_tokens=40,
                          structured_outputs=StructuredOutputsParams(regex=ANSWER))


def test_a_grammar_constrains_the_answer_after_the_thinking_and_chat_text_is_as_generated(llm):
    (out,) = llm.chat(HI, constrained(n=3), use_tqdm=False)
    for seq in out.outputs:
        assert seq.text.startswith(THOUGHT), seq.text
        assert re.fullmatch(ANSWER, seq.text[len(THOUGHT):]) and seq.finish_reason == "stop"


def test_without_a_reasoning_parser_the_grammar_constrains_from_the_first_token(thinking_llama):
    with LLM(str(thinking_llama), max_model_len=256, kv_cache_memory=4 << 20) as plain:
        (out,) = plain.chat(HI, constrained(), use_tqdm=False)
    assert re.fullmatch(ANSWER, out.outputs[0].text)


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_constrained_at_once(llm, tokenizer):
    (out,) = llm.chat(HI, constrained(), chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    assert out.prompt == tokenizer.apply_chat_template(HI, add_generation_prompt=True, enable_thinking=False,
                                                       tokenize=False)
    assert out.prompt.endswith("<think>\n\n</think>\n\n")  # the template closed the think block
    assert re.fullmatch(ANSWER, out.outputs[0].text)


def test_continue_final_message_continues_the_last_assistant_message(llm, tokenizer):
    messages = [*HI, {"role": "assistant", "content": "<think> quick"}]
    (out,) = llm.chat(messages, greedy(), add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    assert out.prompt == tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert out.outputs[0].text == " brown fox</think>"  # [TOOL_CALLS] after it is a special token
    with pytest.raises(Exception, match="cannot both be true"):
        llm.chat(messages, greedy(), continue_final_message=True, use_tqdm=False)


def test_the_eos_token_that_ends_an_output_is_not_part_of_its_text(llm, tokenizer):
    (out,) = llm.chat(HI, greedy(skip_special_tokens=False), use_tqdm=False)
    seq = out.outputs[0]
    assert seq.token_ids[-1] == tokenizer.eos_token_id and seq.finish_reason == "stop"
    assert seq.text == tokenizer.decode(seq.token_ids[:-1], skip_special_tokens=False) == THOUGHT + "[TOOL_CALLS]"
    (kept,) = llm.chat(HI, greedy(skip_special_tokens=False, include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == tokenizer.decode(seq.token_ids, skip_special_tokens=False)
    assert kept.outputs[0].text.endswith("<|im_end|>")

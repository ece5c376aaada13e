"""The reasoning parsers on canned outputs and prompts: where the thinking starts and ends, and streamed prefixes."""
from __future__ import annotations

import pytest
from reasoning_checkpoints import R1_TEMPLATE, write_thinking_tokenizer

from strata import ConfigError
from strata.reasoning import THINK_PARSERS, ReasoningParser


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_thinking_tokenizer(tmp_path_factory.mktemp("thinking_tokenizer"))


@pytest.fixture(scope="module", params=THINK_PARSERS)
def parser(request, tokenizer) -> ReasoningParser:
    return ReasoningParser.create(request.param, tokenizer)


# (output text, whether it starts thinking) -> (reasoning, answer), the same for every <think> parser.
SPLITS = [
    (("<think>\nLet me see.\n</think>\n\nIt is 4.", True), ("\nLet me see.\n", "\n\nIt is 4.")),
    (("Let me see.</think>It is 4.", True), ("Let me see.", "It is 4.")),  # <think> was in the prompt
    (("\n<think>a</think>", True), ("a", "")),
    (("<think>cut off by max_tokens", True), ("cut off by max_tokens", None)),
    (("It is 4. <think>not thinking</think>", False), (None, "It is 4. <think>not thinking</think>")),
    (("<think>x</think>y</think>z", True), ("x", "y</think>z")),  # only the first </think> ends the thinking
]


@pytest.mark.parametrize(("given", "want"), SPLITS)
def test_split_puts_the_thinking_apart_from_the_answer(parser, given, want):
    assert parser.split(*given) == want


@pytest.mark.parametrize(("text", "thinks_first"), [given for given, _ in SPLITS])
def test_streamed_parts_only_grow_into_the_final_parts(parser, text, thinks_first):
    final_reasoning, final_answer = parser.split(text, thinks_first)
    for end in range(len(text) + 1):
        reasoning, answer = parser.split(text[:end], thinks_first, finished=False)
        assert (final_reasoning or "").startswith(reasoning or "")
        if answer is not None:
            assert final_answer is not None and final_answer.startswith(answer)
    # A marker cut in two is held back, not sent as thinking.
    if thinks_first and "</think>" in text:
        cut = text.index("</think>") + 3
        assert "</t" not in parser.split(text[:cut], True, finished=False)[0]


def _prompt(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                         **kwargs)


HI = [{"role": "user", "content": "hi"}]
EARLIER_TURN = [{"role": "user", "content": "hi"},
                {"role": "assistant", "reasoning_content": "greet back", "content": "hello"},
                {"role": "user", "content": "again"}]


def test_the_prompt_decides_whether_the_output_starts_thinking(parser, tokenizer):
    assert parser.thinks_first(_prompt(tokenizer, HI))  # a plain generation prompt: the model thinks first
    # Qwen3's template closes an empty think block when thinking is off: the answer comes at once.
    assert not parser.thinks_first(_prompt(tokenizer, HI, enable_thinking=False), {"enable_thinking": False})
    assert parser.thinks_first(_prompt(tokenizer, HI, chat_template=R1_TEMPLATE))  # <think> opened by the prompt


def test_a_think_block_of_an_earlier_turn_does_not_count(tokenizer):
    # Qwen3's turn markers tell the turns apart (DeepSeek-R1's templates drop earlier thinking altogether).
    assert "</think>" in tokenizer.apply_chat_template(EARLIER_TURN, tokenize=False)
    assert ReasoningParser.create("qwen3", tokenizer).thinks_first(_prompt(tokenizer, EARLIER_TURN))


def test_only_qwen3_takes_enable_thinking_false_when_the_template_ignores_it(tokenizer):
    ids = _prompt(tokenizer, HI, chat_template=R1_TEMPLATE, enable_thinking=False)
    assert not ReasoningParser.create("qwen3", tokenizer).thinks_first(ids, {"enable_thinking": False})
    assert ReasoningParser.create("deepseek_r1", tokenizer).thinks_first(ids, {"enable_thinking": False})


def test_a_tokenizer_without_think_tokens_is_refused_naming_the_flag(tmp_path):
    from checkpoints import write_tokenizer
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    with pytest.raises(ConfigError) as e:
        ReasoningParser.create("qwen3", AutoTokenizer.from_pretrained(tmp_path))
    assert e.value.param == "reasoning_parser" and "<think>" in e.value.message
    assert "--reasoning-parser" in e.value.message


def test_an_unknown_reasoning_parser_is_refused_before_anything_loads():
    from strata.config import EngineConfig

    with pytest.raises(ConfigError) as e:
        EngineConfig.create("/no/such/model", reasoning_parser="qwen9")
    assert e.value.param == "reasoning_parser" and "qwen3" in e.value.message

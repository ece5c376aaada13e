"""gpt-oss's harmony output: the `openai_gptoss` reasoning parser and the `openai` tool-call parser on canned
outputs, whole and streamed in several chunkings (the server's own delta logic), against hand-written expectations."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from harmony_checkpoints import write_harmony_tokenizer

from strata import ConfigError
from strata.reasoning import REASONING_PARSERS, HarmonyReasoningParser, reasoning_parser
from strata.server.serving_chat import _deltas
from strata.server.tool_parsers import tool_call_markers, tool_parsers
from strata.server.tools import ToolPlan


class _Vocabulary:
    """Only the vocabulary: enough for the parser to find what it needs missing."""

    def __init__(self, tokens: tuple[str, ...]) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


with tempfile.TemporaryDirectory() as folder:  # the tokenizer is read whole into memory
    HARMONY_TOKENIZER = write_harmony_tokenizer(Path(folder))
PARSER = reasoning_parser("openai_gptoss", HARMONY_TOKENIZER)
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'

# output text -> (reasoning, content, calls)
OUTPUTS = [
    ("<|channel|>analysis<|message|>Think <b>.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
     ("Think <b>.", "It is 4.", [])),
    ("<|channel|>analysis<|message|>Need weather.<|end|>" + CALL + "<|call|>",
     ("Need weather.", None, [("get_weather", {"city": "Oslo"})])),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL
     + "<|call|>", ("a", "Checking.", [("get_weather", {"city": "Oslo"})])),
    ("<|channel|>analysis<|message|>two calls<|end|>" + CALL + "<|call|><|start|>assistant to=functions.get_time"
     "<|channel|>commentary json<|message|>{}<|call|>",
     ("two calls", None, [("get_weather", {"city": "Oslo"}), ("get_time", {})])),
    ("<|channel|>analysis<|message|>cut off by max_tok", ("cut off by max_tok", None, [])),
    ("<|channel|>final<|message|>No thinking.", (None, "No thinking.", [])),  # the stop token is not in the text
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>analysis to=browser.search<|message|>{}"
     "<|call|>", ("x", None, [])),  # a built-in tool's call is no function call
]


def _whole(text: str):
    reasoning, answer = PARSER.split(text, True)
    content, calls = tool_parsers()["openai"](answer) if answer is not None else (None, [])
    if reasoning is not None and not content:
        content = None
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("text", "want"), OUTPUTS)
def test_analysis_is_reasoning_final_is_content_and_functions_are_calls(text, want):
    assert _whole(text) == want


def _streamed(text: str, cuts: list[int]):
    """What the server sends for the output arriving in pieces ending at `cuts`, reassembled."""
    plan = ToolPlan("auto", parser=tool_parsers()["openai"], markers=tool_call_markers("openai"))
    reasoning, content, calls, sent = "", "", {}, 0
    sent_thinking = 0
    for end in cuts:
        finished = end == len(text)
        thinking, answer = PARSER.split(text[:end], True, finished)
        thinking = thinking or ""
        assert thinking.startswith(reasoning)  # nothing sent is ever taken back
        reasoning += thinking[sent_thinking:]
        sent_thinking = len(thinking)
        if answer is not None and (answer or finished):
            deltas, _, sent = _deltas(plan, answer, sent, finished, "id")
            for delta in deltas:
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, ["", ""])
                    entry[0] += call.function.name or ""
                    entry[1] += call.function.arguments or ""
    return (reasoning or None, content.strip() or None,
            [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())])


@pytest.mark.parametrize(("text", "want"), OUTPUTS)
@pytest.mark.parametrize("chunking", ("characters", "threes", "sevens", "whole"))
def test_streamed_deltas_reassemble_into_the_whole_result(text, want, chunking):
    step = {"characters": 1, "threes": 3, "sevens": 7, "whole": len(text)}[chunking]
    cuts = list(range(step, len(text), step)) + [len(text)]
    assert _streamed(text, cuts) == want


def test_markers_are_held_back_until_they_are_whole():
    assert PARSER.split("<|channel|>final<|message|>Hi<|en", True, finished=False) == (None, "Hi")
    assert PARSER.split("<|channel|>analysis<|message|>x<|end|><|sta", True, finished=False) == ("x", None)
    assert PARSER.split("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", True,
                        finished=False) == ("x", None)


def test_the_parser_is_listed_and_refuses_a_tokenizer_without_harmony_tokens():
    assert "openai_gptoss" in REASONING_PARSERS and isinstance(PARSER, HarmonyReasoningParser)
    assert PARSER.thinks_first([1, 2, 3]) and PARSER.start == "<|channel|>"
    ids = HARMONY_TOKENIZER.convert_tokens_to_ids
    assert PARSER.end_ids == (ids("<|channel|>"), ids("final"), ids("<|message|>"))  # where a grammar may start
    with pytest.raises(ConfigError, match="harmony"):
        reasoning_parser("openai_gptoss", _Vocabulary(("<think>", "</think>")))


def test_raw_output_without_the_reasoning_parser_keeps_analysis_out_of_content():
    text = "<|channel|>analysis<|message|>secret<|end|>" + CALL + "<|call|>"
    content, calls = tool_parsers()["openai"](text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert tool_parsers()["openai"]("plain text") == ("plain text", [])

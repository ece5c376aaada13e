"""The auto tool-call parsers on canned outputs of each model family."""
from __future__ import annotations

import json

import pytest

from strata.server.tool_parsers import ParsedCall, tool_parsers

CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
         None, [("get_weather", {"city": "Oslo"})]),
        ('Let me look. <tool_call>{"name": "a", "arguments": {"x": [[1, 2], [3]]}}</tool_call>'
         '<tool_call>{"name": "b", "arguments": {}}</tool_call>', "Let me look.",
         [("a", {"x": [[1, 2], [3]]}), ("b", {})]),
        ('<tool_call>{"name": "cut", "arguments": {"n": 1}}', None, [("cut", {"n": 1})]),  # no closing tag
        ("just text", "just text", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
        ('<|python_tag|>{"name": "a", "parameters": {"l": [1, [2]]}}; {"name": "b", "parameters": {}}', None,
         [("a", {"l": [1, [2]]}), ("b", {})]),
        ('I will call it. {"name": "a", "parameters": {"q": "x"}}', "I will call it.", [("a", {"q": "x"})]),
        ('a dict {"x": 1} is not a call', 'a dict {"x": 1} is not a call', []),
    ],
    "llama4_pythonic": [
        ('[get_weather(city="Oslo", days=3)]', None, [("get_weather", {"city": "Oslo", "days": 3})]),
        ('<|python_start|>[a(l=[1, [2, 3]], d={"k": None}), b()]<|python_end|>', None,
         [("a", {"l": [1, [2, 3]], "d": {"k": None}}), ("b", {})]),
        ('Checking now: [search(q="x]y")]', "Checking now:", [("search", {"q": "x]y"})]),
        ("a list [1, 2] and no call", "a list [1, 2] and no call", []),
    ],
}


@pytest.mark.parametrize(("parser", "text", "content", "calls"),
                         [(name, *case) for name, cases in CASES.items() for case in cases])
def test_parser_finds_the_calls_and_keeps_the_rest_as_content(parser, text, content, calls):
    got_content, got_calls = tool_parsers()[parser](text)
    assert got_content == content
    assert all(isinstance(c, ParsedCall) for c in got_calls)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls

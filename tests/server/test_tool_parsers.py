"""The auto tool-call parsers on canned outputs of each model family."""
from __future__ import annotations

import json
import re

import pytest

from strata.server.tool_parsers import ParsedCall, tool_call_ids, tool_parsers

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
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None,
         [("get_weather", {"city": "Oslo"})]),
        ('Let me check.[TOOL_CALLS] [{"name": "a", "arguments": {"x": [[1, 2], [3]]}}, {"name": "b", "arguments": {}}]',
         "Let me check.", [("a", {"x": [[1, 2], [3]]}), ("b", {})]),
        # Newer templates: one marker per call, the name, then [ARGS] (or nothing) before the arguments.
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add{"a": 1, "b": [2]}', None,
         [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": [2]})]),
        ('[TOOL_CALLS][{"name": "f", "arguments": "{\\"k\\": 1}"}]', None, [("f", {"k": 1})]),  # arguments as a string
        ("[TOOL_CALLS] is how calls begin, but not here", "[TOOL_CALLS] is how calls begin, but not here", []),
        ('a list [{"name": "x"}] without the marker', 'a list [{"name": "x"}] without the marker', []),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None,
         [("get_weather", {"city": "Oslo"})]),
        ('Sure. <tool_call>[{"name": "a", "arguments": {"q": "<tool_call>[]"}}, {"name": "b", "arguments": {}}]',
         "Sure.", [("a", {"q": "<tool_call>[]"}), ("b", {})]),
        ("a list [1, 2] and no call", "a list [1, 2] and no call", []),
        ("<tool_call> [1, 2]", "<tool_call> [1, 2]", []),
    ],
}


@pytest.mark.parametrize(("parser", "text", "content", "calls"),
                         [(name, *case) for name, cases in CASES.items() for case in cases])
def test_parser_finds_the_calls_and_keeps_the_rest_as_content(parser, text, content, calls):
    got_content, got_calls = tool_parsers()[parser](text)
    assert got_content == content
    assert all(isinstance(c, ParsedCall) for c in got_calls)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def test_mistral_call_ids_are_9_letters_and_digits_and_others_openais():
    ids = {tool_call_ids("mistral")() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids)
    assert all(tool_call_ids(name)().startswith("chatcmpl-tool-") for name in ("hermes", "granite", None))


# What Mistral (both forms) and Granite write, forced by a regex on a tiny model served in-process; the model's
# tokenizer has [TOOL_CALLS] and <|tool_call|> as special tokens, as theirs do.
SERVED = {
    "mistral": [r'Sure\.\[TOOL_CALLS\]\[\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\]',
                r'Sure\.\[TOOL_CALLS\]add\[ARGS\]\{"a": [0-9], "b": [0-9]\}'],
    "granite": [r'Sure\. <\|tool_call\|>\[\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\]'],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]


@pytest.fixture(scope="module")
def engine(thinking_llama):
    from strata.config import EngineConfig
    from strata.engine.async_engine import AsyncEngine

    config = EngineConfig.create(str(thinking_llama), max_model_len=512, kv_cache_memory=4 << 20,
                                 served_model_name="tiny")
    eng = AsyncEngine.from_config(config)
    yield eng
    eng.shutdown()


def _client(engine, parser: str):
    import argparse

    import httpx
    import openai

    from strata.server.app import build_app

    app = build_app(engine, argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser=parser,
                                               disable_log_requests=True))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)


async def _whole_and_streamed(client, regex: str):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "1 + 2?"}], "tools": TOOLS, "temperature": 0,
          "max_tokens": 150, "extra_body": {"structured_outputs": {"regex": regex}}}
    whole = await client.chat.completions.create(**kw)
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kw) if c.choices]
    return whole.choices[0], chunks


@pytest.mark.parametrize(("parser", "regex"), [(p, r) for p, regexes in SERVED.items() for r in regexes])
def test_served_calls_parse_and_streamed_deltas_reassemble(engine, parser, regex):
    import asyncio

    whole, chunks = asyncio.run(_whole_and_streamed(_client(engine, parser), regex))
    assert whole.message.content == "Sure." and whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    id_format = "[A-Za-z0-9]{9}" if parser == "mistral" else "chatcmpl-tool-[0-9a-f]{32}"
    assert re.fullmatch(id_format, call.id)
    deltas = [c.choices[0].delta for c in chunks]
    parts = [part for d in deltas for part in d.tool_calls or []]
    assert re.fullmatch(id_format, parts[0].id) and parts[0].function.name == "add"
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert "".join(d.content or "" for d in deltas).strip() == "Sure."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_special_token_markers_are_kept_but_the_eos_text_is_not(engine):
    import asyncio

    async def plain(parser):
        return await _client(engine, parser).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, temperature=0, max_tokens=20)

    # The model writes `<think> quick brown fox</think>[TOOL_CALLS]`, then EOS. Mistral's marker is a special
    # token, so its requests decode special tokens; hermes' is text, so its requests need not. The EOS that ends
    # the output (<|im_end|>, also special) stays out of the content either way.
    for parser, content in (("mistral", "<think> quick brown fox</think>[TOOL_CALLS]"),
                            ("hermes", "<think> quick brown fox</think>")):
        done = asyncio.run(plain(parser)).choices[0]
        assert done.message.content == content and done.finish_reason == "stop"

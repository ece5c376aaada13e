"""Structured outputs and tool calling through the real server with the openai client."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from conftest import API_KEY, MODEL, start_server, stop_server
from pydantic import BaseModel, Field

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Person(BaseModel):
    name: Literal["Ada", "Alan"]
    age: int = Field(ge=0, le=99)
    likes: list[Literal["tea", "math"]] = Field(max_length=2)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "seed": 1, **kw})


def test_chat_parse_with_a_pydantic_model_gives_a_valid_instance(client):
    completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Person,
                                               max_tokens=120, temperature=1.0, seed=4, n=3)
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, Person)
        assert choice.finish_reason == "stop"


def test_response_format_and_structured_outputs_on_chat_and_completions(client):
    obj = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(obj.choices[0].message.content), WEATHER)
    done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=60, seed=2, n=2,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.text for c in done.choices} <= {"yes", "no"}
    with_logprobs = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=5,
                                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    tops = with_logprobs.choices[0].logprobs.top_logprobs
    assert tops and all(lp >= -9999.0 for top in tops for lp in top.values())  # masked tokens: floor, not -inf
    regex = client.completions.create(model=MODEL, prompt="Hi", max_tokens=60,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert regex.choices[0].text[3] == "-" and len(regex.choices[0].text) == 6
    streamed = client.completions.create(model=MODEL, prompt="Hi", max_tokens=120, stream=True, seed=3,
                                         extra_body={"response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "a", "schema": ADD}}})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in streamed if c.choices)), ADD)


@pytest.mark.parametrize(("kw", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "must be provided"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"extra_body": {"structured_outputs": {"regex": "[.*"}}}, "structured_outputs.regex", "Unclosed"),
    ({"extra_body": {"structured_outputs": {"regex": {"a": 1}}}}, "structured_outputs.regex", "string"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs", "exactly one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [{"type": "function", "function": {"parameters": ADD}}], "tool_choice": "required"}, "tools", "name"),
])
def test_bad_constraints_are_400s_naming_the_param_and_the_server_goes_on(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    error = e.value.body
    assert error["param"] == param and words in error["message"]
    assert chat(client, max_completion_tokens=3).choices[0].message.content is not None


def test_required_and_named_tool_choice_give_calls_that_satisfy_their_schemas(client):
    required = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, n=3, max_tokens=220)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), ADD)


def reassemble(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and call["arguments"] == "", "id and name come first"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(client, tool_choice):
    kw = {"tools": TOOLS, "tool_choice": tool_choice, "temperature": 1.0, "seed": 1, "max_tokens": 220}
    whole = chat(client, **kw)
    streamed, finish = reassemble(chat(client, stream=True, **kw))
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert want
    assert [(c["name"], c["arguments"]) for c in streamed] == want
    assert all(c["id"].startswith("chatcmpl-tool-") for c in streamed) and finish == "tool_calls"


def test_tool_history_reaches_the_chat_template(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3)
    assert out.choices[0].message.content is not None


# What each family writes, forced on the tiny model by a regex: the parser must find the call in it.
FORMATS = {
    "hermes": r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>',
    "llama3_json": r'Sure\. <\|python_tag\|>\{"name": "add", "parameters": \{"a": [0-9], "b": [0-9]\}\}',
    "llama4_pythonic": r"Sure\. \[add\(a=[0-9], b=[0-9]\)\]",
}


@pytest.fixture(scope="module", params=list(FORMATS))
def auto_server(request, server_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("auto_log") / "server.log"
    srv = start_server(server_checkpoint, log, "--max-model-len", "256", "--served-model-name", MODEL, "--api-key",
                       API_KEY, "--kv-cache-memory", "4M", "--enable-auto-tool-choice", "--tool-call-parser",
                       request.param)
    yield request.param, openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert stop_server(srv) == 0


@pytest.mark.slow
def test_auto_tool_choice_parses_each_family_format_out_of_model_text(auto_server):
    parser, client = auto_server
    kw = {"tools": TOOLS, "tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": FORMATS[parser]}}}
    whole = chat(client, **kw)
    message = whole.choices[0].message
    assert message.content == "Sure." and whole.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "add" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    chunks = list(chat(client, stream=True, **kw))
    streamed, finish = reassemble(chunks)
    assert [(c["name"], c["arguments"]) for c in streamed] == [("add", call.function.arguments)]
    assert finish == "tool_calls"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Sure."  # streamed before the call began, the call's text held back
    plain = chat(client, tools=TOOLS, max_tokens=20, extra_body={"structured_outputs": {"regex": "plain words"}})
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].message.content == "plain words"

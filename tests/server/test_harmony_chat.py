"""gpt-oss's harmony end to end: `strata serve --reasoning-parser openai_gptoss --tool-call-parser openai` with the
openai client, on a gpt-oss checkpoint whose weights write harmony (tests/harmony_checkpoints.py): the analysis
channel in reasoning_content, the final channel in content, a commentary-channel call in tool_calls, streamed and
not; a grammar constrains only what follows `<|channel|>final<|message|>`."""
from __future__ import annotations

import json

import openai
import pytest
from conftest import API_KEY, start_server, stop_server
from harmony_checkpoints import ANSWER, ARGUMENTS, THOUGHT

HI = [{"role": "user", "content": "hi"}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def client(harmony_gpt_oss, tmp_path_factory):
    log = tmp_path_factory.mktemp("harmony_log") / "server.log"
    srv = start_server(harmony_gpt_oss, log, "--max-model-len", "256", "--served-model-name", "oss",
                       "--api-key", API_KEY, "--kv-cache-memory", "4M", "--reasoning-parser", "openai_gptoss",
                       "--enable-auto-tool-choice", "--tool-call-parser", "openai")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert stop_server(srv) == 0


def chat(client, messages=HI, **kw):
    return client.chat.completions.create(model="oss", messages=messages, max_tokens=60, temperature=0, **kw)


def test_analysis_is_reasoning_content_and_final_is_content(client):
    choice = chat(client).choices[0]
    assert choice.message.reasoning_content == THOUGHT and choice.message.content == ANSWER
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


def test_a_commentary_call_to_a_function_is_a_tool_call(client):
    choice = chat(client, ASK_WEATHER, tools=TOOLS).choices[0]
    assert choice.message.reasoning_content == THOUGHT and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("messages,tools", [(HI, None), (ASK_WEATHER, TOOLS)], ids=["answer", "call"])
def test_streamed_deltas_join_to_the_whole_response(client, messages, tools):
    kw = {"tools": tools} if tools else {}
    whole = chat(client, messages, **kw).choices[0]
    chunks = [c for c in chat(client, messages, stream=True, **kw) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    calls = [call for d in deltas for call in d.tool_calls or []]
    if tools:
        assert calls[0].function.name == "get_weather"
        assert "".join(c.function.arguments or "" for c in calls) == whole.message.tool_calls[0].function.arguments
    else:
        assert not calls
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert not any("<|" in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)


def test_a_grammar_constrains_only_the_final_channel(client):
    """The thinking and the final header stay free (a grammar over the whole output could not let them through);
    the answer after the header is the grammar's."""
    pattern = r'\{"forecast": "(sunny|rain)"\}'
    choice = chat(client, extra_body={"structured_outputs": {"regex": pattern}}).choices[0]
    assert choice.message.reasoning_content == THOUGHT
    assert json.loads(choice.message.content)["forecast"] in ("sunny", "rain")
    raw = client.completions.create(model="oss", prompt="<|start|>user<|message|>hi<|end|><|start|>assistant",
                                    max_tokens=60, temperature=0,
                                    extra_body={"structured_outputs": {"regex": pattern}, "skip_special_tokens": False})
    thinking = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    assert raw.choices[0].text.startswith(f"{thinking}<|start|>assistant<|channel|>final<|message|>{{\"forecast\": ")


def test_a_named_tool_choice_forces_the_call_after_the_thinking(client):
    """Asked without a word of weather, the model would answer; the named function's schema, applied after the
    final header, makes its answer the call's arguments."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, tools=TOOLS, tool_choice=named).choices[0]
    assert choice.message.reasoning_content == THOUGHT and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS

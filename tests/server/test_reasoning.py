"""`strata serve --reasoning-parser qwen3` with the openai client, on a checkpoint whose weights make it think
`<think> quick brown fox</think>` first: thinking in reasoning_content, the answer (forced by a grammar) in content
and tool calls, streamed and not; chat template keywords, tools and documents reach the template."""
from __future__ import annotations

import json

import openai
import pytest
from conftest import API_KEY, start_server, stop_server
from transformers import AutoTokenizer

THOUGHT = " quick brown fox"
HI = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
# What Qwen3 writes to call a tool (hermes), forced after the thinking.
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def client(thinking_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning_log") / "server.log"
    srv = start_server(thinking_llama, log, "--max-model-len", "512", "--served-model-name", "thinker", "--api-key",
                       API_KEY, "--kv-cache-memory", "4M", "--reasoning-parser", "qwen3",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert stop_server(srv) == 0


def chat(client, **kw):
    return client.chat.completions.create(**{"model": "thinker", "messages": HI, "max_tokens": 150, "temperature": 0,
                                             **kw})


def test_the_thinking_goes_to_reasoning_content_and_a_tool_call_after_it_parses(client):
    plain = chat(client).choices[0]
    assert plain.message.reasoning_content == THOUGHT and plain.message.content is None
    assert plain.finish_reason == "stop"
    called = chat(client, tools=TOOLS, extra_body={"structured_outputs": {"regex": CALL}}).choices[0]
    assert called.message.reasoning_content == THOUGHT and called.message.content is None
    (call,) = called.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert called.finish_reason == "tool_calls"


def test_streamed_thinking_content_and_calls_join_to_the_whole_response(client):
    kw = {"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": CALL}}}
    whole = chat(client, **kw).choices[0]
    chunks = [c for c in chat(client, stream=True, **kw) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == THOUGHT  # vLLM's newer name
    assert not "".join(d.content or "" for d in deltas).strip()
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert "".join(c.function.arguments or "" for c in calls) == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_all_content(client, thinking_llama):
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False},
                         "structured_outputs": {"regex": "The answer is [0-9]\\."}}}
    done = chat(client, **kw)
    message = done.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content.startswith("The answer is ")
    tokenizer = AutoTokenizer.from_pretrained(thinking_llama)
    want = tokenizer.apply_chat_template(HI, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert done.usage.prompt_tokens == len(want)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, stream=True, **kw) if c.choices)
    assert streamed == message.content


def test_tools_documents_history_and_another_template_reach_the_template(client, thinking_llama):
    tokenizer = AutoTokenizer.from_pretrained(thinking_llama)
    documents = [{"title": "Oslo", "text": "It rains a lot."}]
    history = [*HI, {"role": "assistant", "reasoning_content": "look it up", "content": "",
                     "tool_calls": [{"id": "call1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call1", "content": "rain"}]
    done = chat(client, messages=history, tools=TOOLS, max_tokens=2, extra_body={"documents": documents})
    template_history = json.loads(json.dumps(history))
    template_history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    want = tokenizer.apply_chat_template(template_history, tools=TOOLS, documents=documents,
                                         add_generation_prompt=True, return_dict=False)
    assert done.usage.prompt_tokens == len(want)
    # A template whose generation prompt opens the think block (DeepSeek-R1's way): the output has no <think>.
    from reasoning_checkpoints import R1_TEMPLATE

    opened = chat(client, extra_body={"chat_template": R1_TEMPLATE}).choices[0].message
    assert opened.reasoning_content == THOUGHT and opened.content is None

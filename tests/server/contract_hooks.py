"""Schemathesis hooks for the request rules /openapi.json states only in words, because JSON Schema cannot: the
languages inside a request (a regex, a grammar, a JSON Schema to compile), references between fields (a named
tool_choice names one of `tools`; each tool name once) and the prompt's length in tokens. A schema-valid case
gets valid values there, so that every positive case is one the server must accept; negative cases are left
alone. Two knobs bound the work of a positive case (tests set them; None leaves cases as generated).

Also for `schemathesis run`: SCHEMATHESIS_HOOKS=contract_hooks, with tests/server on PYTHONPATH."""
from __future__ import annotations

import copy
import json
from typing import Any

import schemathesis
from schemathesis.generation.modes import GenerationMode

# A positive case whose prompt might not leave the context a token to generate is left out: more token ids than
# this, or more text (in UTF-8 bytes, at least its tokens under a byte-level BPE).
max_prompt_tokens: int | None = None
# Positive cases ask for at most this many new tokens (valid requests cost the test time token by token; the
# limits of max_tokens are coverage cases of their own).
max_new_tokens: int | None = None

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/invocations")
# Each compiles with the structured-outputs backend; one is picked by the generated value, so runs repeat.
REGEXES = ("[a-z]{1,8}", "(yes|no)", r"\d{1,3}(\.\d)?")
GRAMMARS = ('root ::= "a" | "b"', 'root ::= [0-9]+ ("," [0-9]+)*', 'root ::= item+\nitem ::= "x" | "y"')
SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"],
     "additionalProperties": False},
    {"enum": ["red", "green"]},
)


def _pick(options: tuple, generated: Any) -> Any:
    return copy.deepcopy(options[len(json.dumps(generated, default=str)) % len(options)])


def _valid(key: str, generated: Any) -> Any:
    if key == "regex":
        return _pick(REGEXES, generated)
    if key == "grammar":
        return _pick(GRAMMARS, generated)
    schema = _pick(SCHEMAS, generated)  # a JSON Schema, as an object or as JSON text
    return json.dumps(schema) if isinstance(generated, str) else schema


def _make_valid(holder: Any, key: str) -> None:
    if isinstance(holder, dict) and holder.get(key) is not None:
        holder[key] = _valid(key, holder[key])


def _make_tools_valid(body: dict[str, Any]) -> None:
    names = []
    for i, tool in enumerate(body.get("tools") or []):
        function = tool["function"]
        function["name"] = f"{function['name']}_{i}"  # each once
        names.append(function["name"])
        _make_valid(function, "parameters")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and names:
        choice["function"]["name"] = _pick(tuple(names), choice["function"]["name"])


def _prompt_tokens(body: dict[str, Any]) -> int:
    """At least the longest prompt's tokens: its ids, or every text that reaches it plus the chat template's tags
    (truncate_prompt_tokens aside)."""
    def size(value: Any) -> int:
        if isinstance(value, list) and all(isinstance(t, int) for t in value):
            return len(value)
        return len(json.dumps(value, ensure_ascii=False).encode())

    messages = body.get("messages")
    if isinstance(messages, list):
        template = body.get("chat_template")
        return size(messages) + 8 * len(messages) + 16 + (size(template) if template else 0)
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
    return max(size(p) for p in batch) if isinstance(batch[0], str | list) else 0


def _cap_new_tokens(body: dict[str, Any], cap: int) -> None:
    fields = ("max_tokens", "max_completion_tokens") if "messages" in body else ("max_tokens",)
    given = [field for field in fields if body.get(field) is not None]
    for field in given:
        body[field] = min(body[field], cap)
    if not given:  # absent or null: as many as the context holds
        body["max_tokens"] = cap


def _positive(case: Any) -> bool:
    meta = case.meta
    return meta is not None and meta.generation.mode == GenerationMode.POSITIVE and isinstance(case.body, dict)


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    return max_prompt_tokens is None or not _positive(case) or _prompt_tokens(case.body) <= max_prompt_tokens


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    if not _positive(case) or context.operation.path not in (*GENERATION_PATHS, "/tokenize"):
        return case
    body = case.body
    outputs = body.get("structured_outputs")
    for key in ("regex", "grammar", "json"):
        _make_valid(outputs, key)
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        _make_valid(response_format.get("json_schema"), "schema")
    _make_tools_valid(body)
    if max_new_tokens is not None and context.operation.path in GENERATION_PATHS:
        _cap_new_tokens(body, max_new_tokens)
    return case

"""Schemathesis hooks for the request rules /openapi.json states only in words, because JSON Schema cannot: the
languages inside a request (a regex, a grammar, a JSON Schema to compile) and references between fields (a
named tool_choice names one of `tools`; each tool name once). Schema-valid cases get valid values there, so
that a positive case is one the server must accept; negative cases are left alone.

Also for `schemathesis run`: SCHEMATHESIS_HOOKS=contract_hooks (with tests/server on PYTHONPATH)."""
from __future__ import annotations

import copy
import json
from typing import Any

import schemathesis
from schemathesis.generation.modes import GenerationMode

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


def _valid_schema(generated: Any) -> Any:
    schema = _pick(SCHEMAS, generated)
    return json.dumps(schema) if isinstance(generated, str) else schema


def _fix_constraint(holder: Any, key: str) -> None:
    if isinstance(holder, dict) and holder.get(key) is not None:
        value = holder[key]
        holder[key] = {"regex": lambda: _pick(REGEXES, value), "grammar": lambda: _pick(GRAMMARS, value),
                       }.get(key, lambda: _valid_schema(value))()


def _fix_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    names = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        function = tool["function"]
        function["name"] = f"{function['name']}_{i}"  # each once
        names.append(function["name"])
        _fix_constraint(function, "parameters")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and names:
        choice["function"]["name"] = _pick(tuple(names), choice["function"]["name"])


# Prompts must leave the context a token to generate, which only the tokenizer can tell: a positive case whose
# text (UTF-8 bytes, an upper bound of a byte-level BPE's tokens) might not fit is left out. None: no limit.
max_prompt_bytes: int | None = None


def _prompt_bytes(body: dict[str, Any]) -> int:
    """An upper bound of the longest prompt's tokens: every text that reaches it, plus the chat template's tags."""
    def size(value: Any) -> int:
        return len(json.dumps(value, ensure_ascii=False).encode())

    if "messages" in body:
        template = body.get("chat_template")
        return size(body["messages"]) + 8 * len(body["messages"]) + 16 + (size(template) if template else 0)
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else [prompt]
    return max(size(p) for p in batch) if isinstance(batch[0], str) else 0


def _positive(case: Any) -> bool:
    meta = case.meta
    return meta is not None and meta.generation.mode == GenerationMode.POSITIVE and isinstance(case.body, dict)


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    return max_prompt_bytes is None or not _positive(case) or _prompt_bytes(case.body) <= max_prompt_bytes


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    if not _positive(case):
        return case
    body = case.body
    outputs = body.get("structured_outputs")
    for key in ("regex", "grammar", "json"):
        _fix_constraint(outputs, key)
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        _fix_constraint(response_format.get("json_schema"), "schema")
    _fix_tools(body)
    return case

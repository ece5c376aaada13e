"""Tool calling on chat: the tools checked, `tool_choice` turned into a constraint (named and required) or a parser
(auto), and the model's output turned back into OpenAI's `tool_calls`."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata.errors import RequestError
from strata.sampling_params import StructuredOutputsParams
from strata.server.tool_parsers import (
    ParsedCall,
    ToolParser,
    leftover,
    tool_call_ids,
    tool_call_markers,
    tool_parsers,
)
from strata.structured.json_schema import load_schema

_NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request calls tools: `mode` is none | auto | required | named."""

    mode: str
    constraint: StructuredOutputsParams | None = None
    name: str | None = None  # the named function
    parser: ToolParser | None = None
    markers: tuple[str, ...] = ()  # auto: where a call may begin in the text
    new_id: Callable[[], str] = tool_call_ids(None)  # the id of a call (the parser's format, e.g. Mistral's)

    def streamable(self, text: str) -> int:
        """Auto: how much of the text can stream as content, being before any (possibly partial) call marker."""
        end = len(text)
        for marker in self.markers:
            found = text.find(marker)
            if found >= 0:
                end = min(end, found)
            for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker cut off at the end
                if text.endswith(marker[:k]):
                    end = min(end, len(text) - k)
                    break
        return end

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The content and calls of a finished output."""
        if self.mode == "named":
            return None, [ParsedCall(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut off by max_tokens: no call to report
                return leftover(text), []
            return None, [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
        if self.mode == "auto":
            return self.parser(text)
        return text, []


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters schema; malformed definitions are refused naming `tools`."""
    found: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                               param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", param="tools")
        schema = function.get("parameters")
        schema = _NO_ARGUMENTS if schema in (None, {}) else load_schema(schema, f"tools[{i}].function.parameters")
        # The same function listed twice is harmless; one name with two parameter schemas leaves a call ambiguous.
        if found.get(name, schema) != schema:
            raise RequestError(f"tools[{i}]: the function name {name!r} is given twice with different parameters",
                               param="tools")
        found[name] = schema
    return found


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               auto_parser: str | None) -> ToolPlan:
    """The request's ToolPlan; `auto_parser` is the server's --tool-call-parser when auto is enabled."""
    try:
        schemas = check_tools(tools)
    except RequestError as e:
        raise RequestError(e.message, param="tools") from None
    if tool_choice is None:
        tool_choice = "auto" if schemas and auto_parser else "none"
    if tool_choice == "none":
        return ToolPlan("none")
    if not schemas:
        raise RequestError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
    new_id = tool_call_ids(auto_parser)
    if tool_choice == "auto":
        if auto_parser is None:
            raise RequestError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                               "--tool-call-parser", param="tool_choice")
        return ToolPlan("auto", parser=tool_parsers()[auto_parser], markers=tool_call_markers(auto_parser),
                        new_id=new_id)
    if tool_choice == "required":
        return ToolPlan("required", StructuredOutputsParams(json=required_schema(schemas)), new_id=new_id)
    named = isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function"
    function = tool_choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": ...}}', param="tool_choice")
    if name not in schemas:
        raise RequestError(f"tool_choice names the function {name!r}, which is not among tools "
                           f"({', '.join(schemas)})", param="tool_choice")
    return ToolPlan("named", StructuredOutputsParams(json=schemas[name]), name=name, new_id=new_id)


def required_schema(schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A non-empty array of calls, each an offered tool's name with arguments that satisfy its schema."""
    calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in schemas.items()]
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls' arguments as objects, as HF chat templates expect (OpenAI sends JSON strings); an
    assistant's earlier thinking as `reasoning_content` (Qwen3's templates read it) also when sent as `reasoning`."""
    for message in messages:
        if message.get("reasoning") is not None and message.get("reasoning_content") is None:
            message["reasoning_content"] = message["reasoning"]
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    raise RequestError("a tool call's function.arguments in messages is not valid JSON",
                                       param="messages") from None
    return messages

"""Tool-call parsers for `tool_choice="auto"`: each finds the calls a model family writes in free text.

A parser takes the whole output and returns the text outside the calls (None when there is none; the text as it
is when there is no call) and the calls, each a name and its arguments as a JSON string. Its MARKERS are where a
call may begin; its `call_id`, when it has one, makes the ids of the calls (else OpenAI's `chatcmpl-tool-<hex>`).
"""
from __future__ import annotations

from collections.abc import Callable

from strata.server.tool_parsers import granite, hermes, llama3_json, llama4_pythonic, mistral, openai
from strata.server.tool_parsers.base import ParsedCall, ToolParser, leftover, openai_call_id

__all__ = ["ParsedCall", "ToolParser", "leftover", "tool_parsers", "tool_call_markers", "tool_call_ids",
           "TOOL_CALL_PARSERS"]

_MODULES = {"llama3_json": llama3_json, "llama4_pythonic": llama4_pythonic, "hermes": hermes, "mistral": mistral,
            "granite": granite, "openai": openai}
TOOL_CALL_PARSERS = tuple(_MODULES)


def tool_parsers() -> dict[str, ToolParser]:
    return {name: module.parse for name, module in _MODULES.items()}


def tool_call_markers(name: str) -> tuple[str, ...]:
    return _MODULES[name].MARKERS


def tool_call_ids(name: str | None) -> Callable[[], str]:
    """The maker of call ids for the parser `name` (None: no parser)."""
    return getattr(_MODULES.get(name), "call_id", openai_call_id)

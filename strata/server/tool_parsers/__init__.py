"""Tool-call parsers for `tool_choice="auto"`: each finds the calls a model family writes in free text.

A parser takes the whole output and returns the text outside the calls (None when there is none; the text as it
is when there is no call) and the calls, each a name and its arguments as a JSON string. Its MARKERS are where a
call may begin.
"""
from __future__ import annotations

from strata.server.tool_parsers import hermes, llama3_json, llama4_pythonic
from strata.server.tool_parsers.base import ParsedCall, ToolParser, leftover

__all__ = ["ParsedCall", "ToolParser", "leftover", "tool_parsers", "tool_call_markers"]

_MODULES = {"llama3_json": llama3_json, "llama4_pythonic": llama4_pythonic, "hermes": hermes}


def tool_parsers() -> dict[str, ToolParser]:
    return {name: module.parse for name, module in _MODULES.items()}


def tool_call_markers(name: str) -> tuple[str, ...]:
    return _MODULES[name].MARKERS

"""Tool-call parsers for `tool_choice="auto"`: each finds the calls a model family writes in free text.

A parser takes the whole output and returns the text outside the calls (None when there is none) and the calls,
each a name and its arguments as a JSON string.
"""
from __future__ import annotations

from strata.server.tool_parsers import hermes, llama3_json, llama4_pythonic
from strata.server.tool_parsers.base import ParsedCall, ToolParser, leftover

__all__ = ["ParsedCall", "ToolParser", "leftover", "tool_parsers"]


def tool_parsers() -> dict[str, ToolParser]:
    return {"llama3_json": llama3_json.parse, "llama4_pythonic": llama4_pythonic.parse, "hermes": hermes.parse}

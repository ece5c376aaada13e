"""Tool-call parsers for `tool_choice="auto"`: each finds the calls a model family writes in free text.

`parse(text)` returns the text outside the calls (None when there is none) and the calls, each a name and its
arguments as a JSON string.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # a JSON object


ToolParser = Callable[[str], tuple[str | None, list[ParsedCall]]]


def tool_parsers() -> dict[str, ToolParser]:
    from strata.server.tool_parsers import hermes, llama3_json, llama4_pythonic

    return {"llama3_json": llama3_json.parse, "llama4_pythonic": llama4_pythonic.parse, "hermes": hermes.parse}


def leftover(text: str) -> str | None:
    text = text.strip()
    return text or None

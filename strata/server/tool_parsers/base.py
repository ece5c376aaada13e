"""What every tool-call parser returns, and what several share: calls written as JSON, OpenAI's call ids."""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # a JSON object


ToolParser = Callable[[str], tuple[str | None, list[ParsedCall]]]


def leftover(text: str) -> str | None:
    """The content outside the calls; None when only whitespace is left."""
    text = text.strip()
    return text or None


def json_calls(value: Any) -> list[ParsedCall] | None:
    """Calls written as a JSON list of {"name", "arguments"} objects (or one such object; "parameters" is read
    too, a missing one is `{}`); None when the value is not that. String arguments are taken as written."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ParsedCall(item["name"], arguments if isinstance(arguments, str)
                                else json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def openai_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"

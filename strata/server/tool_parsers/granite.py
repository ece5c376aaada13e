"""Granite 3.x: `<|tool_call|>` (3.0, a special token) or `<tool_call>` (3.1) then a JSON list of {"name",
"arguments"}, with no closing marker; text around the list is content."""
from __future__ import annotations

import json
import re

from strata.server.tool_parsers.base import ParsedCall, json_calls, leftover

MARKERS = ("<|tool_call|>", "<tool_call>")  # where calls may begin: text from there on is held back while streaming
_MARKER = re.compile(r"<\|tool_call\|>|<tool_call>")
_DECODER = json.JSONDecoder()


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    calls, kept, last = [], [], 0
    for marker in _MARKER.finditer(text):
        if marker.start() < last:  # inside the list of an earlier marker
            continue
        start = marker.end() + len(text[marker.end():]) - len(text[marker.end():].lstrip())
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        found = json_calls(value)
        if found is None:
            continue
        calls.extend(found)
        kept.append(text[last:marker.start()])
        last = end
    if not calls:
        return text, []
    kept.append(text[last:])
    return leftover("".join(kept)), calls

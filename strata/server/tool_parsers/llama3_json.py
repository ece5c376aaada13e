"""Llama 3.1 / 3.2: JSON objects `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`, several
separated by `;`; calls after ordinary text are found too."""
from __future__ import annotations

import json

from strata.server.tool_parsers.base import ParsedCall, leftover

MARKERS = ("<|python_tag|>", "{")  # where calls may begin: text from there on is held back while streaming
_DECODER = json.JSONDecoder()


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    original, text = text, text.replace("<|python_tag|>", "")
    calls, kept, position = [], [], 0
    start = text.find("{")
    while start >= 0:
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict) and isinstance(value.get("name"), str) and (
                "parameters" in value or "arguments" in value):
            arguments = value.get("parameters", value.get("arguments"))
            calls.append(ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False)))
            kept.append(text[position:start])
            position = end
        start = text.find("{", end)
    if not calls:
        return original, []
    kept.append(text[position:])
    # The `;` between calls is syntax, not content.
    return leftover("".join(part.strip().strip(";") for part in kept)), calls

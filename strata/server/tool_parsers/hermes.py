"""Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text outside is content."""
from __future__ import annotations

import json
import re

from strata.server.tool_parsers.base import ParsedCall, leftover

# A final block may be cut off before its closing tag (max_tokens, or a stop string on it).
MARKERS = ("<tool_call>",)  # where calls may begin: text from there on is held back while streaming
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    return leftover("".join(kept)), calls

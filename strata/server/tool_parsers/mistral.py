"""Mistral: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (v0.3 templates), or `[TOOL_CALLS]name[ARGS]{...}`
once per call (newer templates); text before the first marker is content. Call ids are 9 letters and digits, the
only ids Mistral's templates accept when the calls come back in the conversation."""
from __future__ import annotations

import json
import re
import secrets
import string

from strata.server.tool_parsers.base import ParsedCall, json_calls, leftover

MARKERS = ("[TOOL_CALLS]",)  # where calls may begin: text from there on is held back while streaming
_ARGS = "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*")
_DECODER = json.JSONDecoder()
_ID_CHARACTERS = string.ascii_letters + string.digits


def call_id() -> str:
    return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    head, *segments = text.split(MARKERS[0])
    calls, kept = [], [head]
    for segment in segments:
        found, rest = _segment_calls(segment)
        if found is None:  # not a call after all: the marker and what follows stay content
            kept.append(MARKERS[0] + segment)
            continue
        calls.extend(found)
        kept.append(rest)
    if not calls:
        return text, []
    return leftover("".join(kept)), calls


def _segment_calls(segment: str) -> tuple[list[ParsedCall] | None, str]:
    """The calls at the start of the text after one marker, and the text after them."""
    start = len(segment) - len(segment.lstrip())
    if segment[start:start + 1] in ("[", "{"):  # a JSON list of calls (or one call object)
        try:
            value, end = _DECODER.raw_decode(segment, start)
        except json.JSONDecodeError:
            return None, segment
        return json_calls(value), segment[end:]
    name = _NAME.match(segment)
    if name is None:
        return None, segment
    at = name.end()
    if segment.startswith(_ARGS, at):
        at += len(_ARGS)
    at += len(segment[at:]) - len(segment[at:].lstrip())
    try:
        arguments, end = _DECODER.raw_decode(segment, at)
    except json.JSONDecodeError:
        return None, segment
    if not isinstance(arguments, dict):
        return None, segment
    return [ParsedCall(name.group(1), json.dumps(arguments, ensure_ascii=False))], segment[end:]

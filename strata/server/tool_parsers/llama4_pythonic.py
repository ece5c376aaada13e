"""Llama 4: a Python list of calls `[get_weather(city="Oslo"), add(a=1, b=2)]`, maybe inside `<|python_start|>`
and `<|python_end|>`; argument values are Python literals (nested lists and dicts included)."""
from __future__ import annotations

import ast
import json
import re

from strata.server.tool_parsers.base import ParsedCall, leftover

MARKERS = ("<|python_start|>", "[")  # where calls may begin: text from there on is held back while streaming
_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    original, text = text, text.replace("<|python_start|>", "").replace("<|python_end|>", "")
    for match in _START.finditer(text):
        end = text.find("]", match.start())
        while end >= 0:  # the shortest `[...]` from here that is a list of calls
            calls = _calls(text[match.start():end + 1])
            if calls is not None:
                return leftover(text[:match.start()] + text[end + 1:]), calls
            end = text.find("]", end + 1)
    return original, []


def _calls(source: str) -> list[ParsedCall] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
        return None
    calls = []
    for call in tree.elts:
        if call.args or any(k.arg is None for k in call.keywords):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        except ValueError:
            return None
        calls.append(ParsedCall(ast.unparse(call.func), json.dumps(arguments, ensure_ascii=False)))
    return calls

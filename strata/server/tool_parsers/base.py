"""What every tool-call parser returns."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # a JSON object


ToolParser = Callable[[str], tuple[str | None, list[ParsedCall]]]


def leftover(text: str) -> str | None:
    """The content outside the calls; None when only whitespace is left."""
    text = text.strip()
    return text or None

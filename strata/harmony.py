"""OpenAI's harmony output format (gpt-oss), read from detokenized text kept with its special tokens: the messages of
an output, each with its channel (analysis, commentary, final), recipient (`to=functions.NAME`) and content. Shared
by the `openai_gptoss` reasoning parser (strata/reasoning.py) and the `openai` tool-call parser."""
from __future__ import annotations

import re
from typing import NamedTuple

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"  # what opens the answer: structured outputs constrain what follows
FUNCTIONS = "functions."  # the recipients that are the request's tools
TERMINATORS = (END, RETURN, CALL)  # what closes a message: <|return|> the last answer, <|call|> a tool call
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")


class Message(NamedTuple):
    channel: str | None  # None: text outside harmony's markup, taken as content
    recipient: str | None  # e.g. functions.get_weather
    content: str
    closed: bool  # its terminator was read


def messages(text: str, finished: bool = True) -> list[Message]:
    """The messages of an output's text, in order. While not finished, the last message holds back a tail that may
    still grow into a terminator, and a header not yet read up to <|message|> gives no message, so that the
    messages of a prefix only ever grow into those of the whole text."""
    found: list[Message] = []
    at = 0
    while at < len(text):
        if not text.startswith((START, CHANNEL, MESSAGE), at):
            if not finished and _prefix_at_end(text[at:], (START, CHANNEL)) == len(text) - at:
                break  # a marker still arriving
            stop = _first(text, (START, CHANNEL), at)
            held = _prefix_at_end(text[at:stop], (START, CHANNEL)) if stop == len(text) and not finished else 0
            found.append(Message(None, None, text[at:stop - held], True))
            at = stop - held
            continue
        body = text.find(MESSAGE, at)
        if body < 0:
            break  # the header is not complete
        channel, recipient = _header(text[at:body])
        at = body + len(MESSAGE)
        stop = _first(text, TERMINATORS, at)
        closed = stop < len(text)
        content = text[at:stop]
        if not closed and not finished:
            content = content[:len(content) - _prefix_at_end(content, TERMINATORS)]
        found.append(Message(channel, recipient, content, closed))
        at = stop + (_terminator_length(text, stop) if closed else 0)
    return found


def _header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of the text between a message's start and its <|message|>: `<|start|>assistant`, then
    `<|channel|>NAME`, the recipient either after the role or after the channel, and `<|constrain|>json` perhaps."""
    channel = None
    at = header.find(CHANNEL)
    if at >= 0:
        words = header[at + len(CHANNEL):].split(CONSTRAIN)[0].split()
        channel = words[0] if words and not words[0].startswith("to=") else None
    recipient = _RECIPIENT.search(header)
    return channel, recipient.group(1) if recipient else None


def _first(text: str, markers: tuple[str, ...], at: int) -> int:
    """Where the first of `markers` occurs from `at` on; len(text) when none does."""
    hits = [i for i in (text.find(m, at) for m in markers) if i >= 0]
    return min(hits, default=len(text))


def _terminator_length(text: str, at: int) -> int:
    return next(len(t) for t in TERMINATORS if text.startswith(t, at))


def _prefix_at_end(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest proper prefix of any of `markers` that `text` ends with."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def call_markup(message: Message) -> str:
    """A message to a recipient written back in harmony's markup, as the `openai` tool-call parser reads it."""
    return (f"{CHANNEL}{message.channel or 'commentary'} to={message.recipient}{MESSAGE}{message.content}"
            + (CALL if message.closed else ""))

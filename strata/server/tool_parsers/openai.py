"""OpenAI's harmony format (gpt-oss): a tool call is a message to `functions.NAME`, usually on the commentary
channel, its arguments JSON (`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}
<|call|>`). Read from raw output or from the answer of the `openai_gptoss` reasoning parser, which keeps calls in
this markup; final-channel and preamble text is content, analysis text never is."""
from __future__ import annotations

import json

from strata import harmony
from strata.server.tool_parsers.base import ParsedCall, leftover

# Where calls may begin: the recipient after the channel (as gpt-oss writes it) or after the role.
MARKERS = (f"{harmony.CHANNEL}commentary to=", f"{harmony.CHANNEL}analysis to=", f"{harmony.START}assistant to=")


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    calls, kept = [], []
    for message in harmony.messages(text):
        if message.recipient is not None:
            if message.recipient.startswith(harmony.FUNCTIONS):
                calls.append(ParsedCall(message.recipient[len(harmony.FUNCTIONS):], _arguments(message.content)))
            continue  # built-in tools (browser, python), which strata does not run, are no calls of the request
        if message.channel != "analysis":
            kept.append(message.content)
    if not calls:
        return text, []
    return leftover("".join(kept)), calls


def _arguments(content: str) -> str:
    """The arguments as compact JSON when they parse, else as written (a call cut off by max_tokens)."""
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        return content.strip()
    return json.dumps(value, ensure_ascii=False)

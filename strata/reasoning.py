"""Reasoning parsers (`--reasoning-parser`): where a model's thinking ends and its answer begins. The server puts
the thinking in `reasoning_content`; the engine lets a request's grammar constrain the answer only. `<think>` formats
(ReasoningParser) and gpt-oss's harmony channels (HarmonyReasoningParser)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from strata import harmony
from strata.errors import ConfigError


@dataclass(frozen=True)
class _ThinkFormat:
    start: str
    end: str
    # Tokens that open or close a chat turn: a think block before the newest of them belongs to an earlier turn.
    turn_markers: tuple[str, ...]
    # Qwen3's templates switch thinking off with `enable_thinking=False`; DeepSeek-R1 always thinks.
    honours_enable_thinking: bool


_FORMATS = {
    "deepseek_r1": _ThinkFormat("<think>", "</think>", ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
                                False),
    "qwen3": _ThinkFormat("<think>", "</think>", ("<|im_start|>", "<|im_end|>"), True),
}
THINK_PARSERS = tuple(sorted(_FORMATS))
HARMONY_PARSER = "openai_gptoss"  # vLLM's name
REASONING_PARSERS = tuple(sorted((*_FORMATS, HARMONY_PARSER)))


@dataclass(frozen=True)
class ReasoningParser:
    """A `<think>...</think>` format bound to one tokenizer. Its thinking starts at the first output token unless
    the prompt already closed the think block (or the request turned thinking off); a leading `<think>` in the
    output is dropped (DeepSeek-R1's templates put it in the prompt instead); the first `</think>` token ends it."""

    name: str
    start: str
    end: str
    start_id: int
    end_id: int
    turn_ids: frozenset[int]
    honours_enable_thinking: bool

    @classmethod
    def create(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """The parser `name` for this tokenizer, whose vocabulary must hold both markers as single tokens."""
        fmt = _FORMATS.get(name)
        if fmt is None:
            raise ConfigError(f"unknown reasoning parser {name!r}; the choices are {', '.join(REASONING_PARSERS)}",
                              param="reasoning_parser")
        vocab = tokenizer.get_vocab()
        missing = [marker for marker in (fmt.start, fmt.end) if marker not in vocab]
        if missing:
            raise ConfigError(f"--reasoning-parser {name} needs {fmt.start} and {fmt.end} as tokens of the "
                              f"tokenizer, which has no {' or '.join(missing)}: this model does not think in that "
                              "format; leave --reasoning-parser out", param="reasoning_parser")
        turn_ids = frozenset(vocab[m] for m in fmt.turn_markers if m in vocab)
        return cls(name, fmt.start, fmt.end, vocab[fmt.start], vocab[fmt.end], turn_ids, fmt.honours_enable_thinking)

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The tokens that end the thinking (what the engine's grammar waits for)."""
        return (self.end_id,)

    def thinks_first(self, prompt_token_ids: Sequence[int], chat_template_kwargs: Mapping[str, Any] | None = None
                     ) -> bool:
        """Whether the output starts inside a think block. The newest think marker of the prompt's current turn
        decides (`</think>`: the template closed the block, as Qwen3's does for enable_thinking=False; `<think>`:
        it opened one); without one the model is expected to think."""
        if self.honours_enable_thinking and (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            return False
        for token in reversed(prompt_token_ids):
            if token == self.end_id:
                return False
            if token == self.start_id:
                return True
            if token in self.turn_ids:
                break
        return True

    def split(self, text: str, thinks_first: bool, finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, answer) of an output's text: the answer is None until the thinking has ended, the reasoning
        None when the output does not think. While not finished, a tail that may still grow into a marker is
        held back, so what a stream has sent is always a prefix of the final parts."""
        if not thinks_first:
            return None, text
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not finished and self.start.startswith(body):
            return "", None
        else:
            body = text
        at = body.find(self.end)
        if at >= 0:
            return body[:at], body[at + len(self.end):]
        if not finished:
            body = body[:len(body) - _marker_prefix_at_end(body, self.end)]
        return body, None


def _marker_prefix_at_end(text: str, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class HarmonyReasoningParser:
    """gpt-oss's harmony format: the analysis channel is the thinking; the final channel, and commentary to no
    recipient (preambles meant for the user), the answer. A message to a recipient (a tool call, on any channel)
    stays in the answer in harmony's markup, for the `openai` tool-call parser (a built-in tool's, e.g. browser's, is
    dropped). `start` and `end` are special tokens, so the server keeps special tokens in the text. The engine's
    grammar (structured outputs) starts after the final channel's header, `<|channel|>final<|message|>` (`end_ids`):
    analysis, preambles and the header itself stay free."""

    name: str
    end_ids: tuple[int, ...]
    start: str = harmony.CHANNEL
    end: str = harmony.END

    @classmethod
    def create(cls, tokenizer: Any) -> HarmonyReasoningParser:
        vocab = tokenizer.get_vocab()
        needed = (harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.END)
        missing = [marker for marker in needed if marker not in vocab]
        if missing:
            raise ConfigError(f"--reasoning-parser {HARMONY_PARSER} needs harmony's {', '.join(needed)} as tokens of "
                              f"the tokenizer, which has no {' or '.join(missing)}: this model does not write the "
                              "harmony format; leave --reasoning-parser out", param="reasoning_parser")
        return cls(HARMONY_PARSER, tuple(tokenizer.encode(harmony.FINAL_HEADER, add_special_tokens=False)))

    def thinks_first(self, prompt_token_ids: Sequence[int], chat_template_kwargs: Mapping[str, Any] | None = None
                     ) -> bool:
        """Always: every output opens a message, whose channel tells thinking from answer."""
        return True

    def split(self, text: str, thinks_first: bool = True, finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, answer) of an output's text: the analysis messages joined by newlines (None without one),
        and the other messages' contents (None until one's header has been read). While not finished, markers still
        arriving are held back, so what a stream has sent is always a prefix of the final parts."""
        thinking, answer = [], []
        for message in harmony.messages(text, finished):
            if message.recipient is not None:  # built-in tools' calls (browser, python) strata does not run
                if message.recipient.startswith(harmony.FUNCTIONS):
                    answer.append(harmony.call_markup(message))
            elif message.channel == "analysis":
                thinking.append(message.content)
            else:
                answer.append(message.content)
        return "\n".join(thinking) if thinking else None, "".join(answer) if answer else None


def reasoning_parser(name: str | None, tokenizer: Any) -> ReasoningParser | HarmonyReasoningParser | None:
    if name == HARMONY_PARSER:
        return HarmonyReasoningParser.create(tokenizer)
    return None if name is None else ReasoningParser.create(name, tokenizer)

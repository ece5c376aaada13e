"""Prompt-lookup (n-gram) proposals: the longest suffix of a request's tokens (between prompt_lookup_min and
prompt_lookup_max long) found earlier in its prompt and output proposes the tokens that followed it there."""
from __future__ import annotations

import numpy as np

from strata.config.speculative_config import SpeculativeConfig
from strata.engine.request import Request


class TokenHistory:
    """Each request's token ids as an int32 array grown in place, so a proposal scans them with numpy instead of
    converting the whole list every step."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens written)

    def of(self, request: Request) -> np.ndarray:
        buffer, written = self._arrays.get(request.request_id, (np.zeros(0, np.int32), 0))
        total = request.num_tokens
        if written > total:  # never expected (token ids only grow while a request runs): start over
            written = 0
        if buffer.size < total:
            grown = np.zeros(max(2 * buffer.size, total, 64), np.int32)
            grown[:written] = buffer[:written]
            buffer = grown
        if written < total:
            buffer[written:total] = request.token_ids[written:total]
        self._arrays[request.request_id] = (buffer, total)
        return buffer[:total]

    def drop(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)


def latest_longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(n, end) of the longest suffix of `tokens`, n <= max_n tokens, that also ends at an earlier position `end`
    (the latest such when several do); (0, -1) when none of at least `min_n` tokens does."""
    size = tokens.size
    if size < 2:
        return 0, -1
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # earlier occurrences of the last token
    best = (1, int(ends[-1])) if ends.size else (0, -1)
    for j in range(1, min(max_n, size - 1)):
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[size - 1 - j]]
        if ends.size == 0:
            break
        best = (j + 1, int(ends[-1]))
    return best if best[0] >= min_n else (0, -1)


def continuation(tokens: np.ndarray, start: int, count: int) -> list[int]:
    """`count` tokens from `start` on, continuing into the proposal itself past the end of `tokens`: a match that
    overlaps the suffix (a repeating pattern) proposes the pattern's next repetitions."""
    proposal = tokens[start:start + count].tolist()
    while len(proposal) < count:
        proposal.append(proposal[len(proposal) - (tokens.size - start)])
    return proposal


class NgramProposer:
    """vLLM's `ngram` method (prompt lookup decoding), O(sequence length) numpy work per request and step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.history = TokenHistory()

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        tokens = self.history.of(request)
        n, end = latest_longest_match(tokens, self.min_n, self.max_n)
        return continuation(tokens, end + 1, max_tokens) if n else []

    def finish(self, request: Request) -> None:
        self.history.drop(request.request_id)

"""Per-request output state: detokenization, stop conditions, logprobs and n > 1 fan-out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.engine.request import Request, RequestStatus
from strata.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, TokenLogprobs
from strata.sampling_params import SamplingParams
from strata.tokenizer import IncrementalDetokenizer, fast_decoder


class TokenTextCache:
    """Decoded text of single token ids, for logprobs (the vocabulary is fixed, so this is bounded)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = fast_decoder(tokenizer, skip_special_tokens=False)
        self._text: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._decode([token_id])
        return text

    def position(self, token: int, lps: TokenLogprobs) -> PositionLogprobs:
        """The chosen token first, then its top-k alternatives (the chosen one only once)."""
        entry = {t: Logprob(lp, r + 1, self(t))
                 for r, (t, lp) in enumerate(zip(lps.top_ids, lps.top_logprobs, strict=True))}
        if token not in entry:
            entry[token] = Logprob(lps.logprob, lps.rank, self(token))
        else:
            entry = {token: entry.pop(token), **entry}
        return entry


def stop_condition(request: Request, stop_string: str | None, pending: int = 0
                   ) -> tuple[RequestStatus, int | str | None] | None:
    """Whether the request's last token ends it, and why: every stop rule in one place, in order of precedence.
    EOS and stop_token_ids (once min_tokens are out), then length, then a stop string found in the text.
    `pending`: tokens of the same step after the one checked (accepted draft tokens), already appended."""
    token, params = request.token_ids[-1 - pending], request.sampling_params
    num_output, num_tokens = request.num_output_tokens - pending, request.num_tokens - pending
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in params.all_stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if num_output >= request.max_tokens or num_tokens >= request.max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    if stop_string is not None:
        return RequestStatus.FINISHED_STOPPED, stop_string
    return None


@dataclass
class SequenceState:
    request_id: str  # the scheduler's id of this sample
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestGroup:
    """One user request: its prompt and its n samples, each a separate scheduler request."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Any) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params = params
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        self.sequences = [
            SequenceState(rid, i, IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop,
                                                         params.include_stop_str_in_output,
                                                         params.skip_special_tokens),
                          logprobs=[] if params.logprobs is not None else None)
            for i, rid in enumerate(ids)]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] + [{}] * (len(prompt_token_ids) - 1) if params.prompt_logprobs is not None else None)
        self.num_cached_tokens = 0
        self.metrics: dict[str, float] = {}  # queue_time (s): arrival to first scheduled

    def child_params(self, index: int) -> SamplingParams:
        if self.params.n == 1:
            return self.params
        seed = None if self.params.seed is None else self.params.seed + index
        return self.params.clone(n=1, seed=seed)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        finished = self.finished
        # Copies: the engine thread keeps appending while a server coroutine reads this output.
        outputs = [CompletionOutput(s.index, s.detokenizer.visible_text(s.finish_reason is not None),
                                    list(s.token_ids), None if s.logprobs is None else list(s.logprobs),
                                    s.finish_reason, s.stop_reason,
                                    s.cumulative_logprob if s.logprobs is not None else None)
                   for s in self.sequences]
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             prompt_logprobs, self.num_cached_tokens, dict(self.metrics))

"""Output processing: per user request (its n samples), the core's new token ids become text (incremental
detokenization, stop strings), logprobs get their token text, and RequestOutputs are built. The output token ids
are kept here once. A stop string ends a sample here; the core hears of it through `finished_ids`, and the tokens
it made for that sample meanwhile are dropped."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.engine.request import CoreOutput, CoreRequest, RequestStatus
from strata.errors import RequestError
from strata.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, TokenLogprobs
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


@dataclass
class SequenceState:
    request_id: str  # the scheduler's id of this sample
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # the one list of this sample's output tokens
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestGroup:
    """One user request: its prompt and its n samples, each a separate scheduler request."""

    def __init__(self, request: CoreRequest, tokenizer: Any) -> None:
        params, prompt_token_ids = request.params, request.prompt.token_ids
        self.request_id, self.prompt, self.prompt_token_ids = request.request_id, request.prompt.text, prompt_token_ids
        self.params = params
        self.sequences = [
            SequenceState(sample_id, i, IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop,
                                                               params.include_stop_str_in_output,
                                                               params.skip_special_tokens),
                          logprobs=[] if params.logprobs is not None else None)
            for i, sample_id in enumerate(request.sample_ids)]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] + [{}] * (len(prompt_token_ids) - 1) if params.prompt_logprobs is not None else None)
        self.num_cached_tokens = 0
        self.metrics: dict[str, float] = {}  # queue_time (s): arrival to first scheduled

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        finished = self.finished
        # Copies: more tokens are appended to these lists while a server coroutine reads this output.
        outputs = [CompletionOutput(s.index, s.detokenizer.visible_text(s.finish_reason is not None),
                                    list(s.token_ids), None if s.logprobs is None else list(s.logprobs),
                                    s.finish_reason, s.stop_reason,
                                    s.cumulative_logprob if s.logprobs is not None else None)
                   for s in self.sequences]
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             prompt_logprobs, self.num_cached_tokens, dict(self.metrics))


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    finished_ids: list[str]  # samples a stop string ended, which the core is still running


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTextCache(tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        self.sequence_of: dict[str, tuple[RequestGroup, SequenceState]] = {}
        self.num_generation_tokens = 0  # tokens that reached an output

    def add_request(self, request: CoreRequest) -> None:
        if request.request_id in self.groups:
            raise RequestError(f"request id {request.request_id!r} is already running", param="request_id")
        group = RequestGroup(request, self.tokenizer)
        self.groups[request.request_id] = group
        for seq in group.sequences:
            self.sequence_of[seq.request_id] = (group, seq)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a user request; returns the ids the core should abort (its samples', and its own while they wait
        for a grammar)."""
        group = self.groups.get(request_id)
        if group is None:
            return [request_id]
        self._forget(group)
        return list(dict.fromkeys([request_id, *(seq.request_id for seq in group.sequences)]))

    def _forget(self, group: RequestGroup) -> None:
        del self.groups[group.request_id]
        for seq in group.sequences:
            self.sequence_of.pop(seq.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def process_outputs(self, outputs: list[CoreOutput]) -> ProcessedOutputs:
        """One step's core outputs -> the RequestOutputs of the user requests they changed."""
        touched: dict[str, RequestGroup] = {}
        finished_ids: list[str] = []
        for out in outputs:
            found = self.sequence_of.get(out.request_id)
            if found is None:
                continue  # aborted, or its group already ended: the core's tokens for it are dropped
            group, seq = found
            if out.prompt_logprobs is not None and seq.index == 0 and group.prompt_logprobs is not None:
                for position, lps in enumerate(out.prompt_logprobs.positions, out.prompt_logprobs.start):
                    group.prompt_logprobs[position] = self.token_text.position(group.prompt_token_ids[position], lps)
                touched[group.request_id] = group
            if out.new_token_ids and seq.finish_reason is None:
                if self._apply_tokens(group, seq, out):
                    finished_ids.append(seq.request_id)
                touched[group.request_id] = group
        request_outputs = []
        for group in touched.values():
            request_outputs.append(group.output())
            if group.finished:
                self._forget(group)
        return ProcessedOutputs(request_outputs, finished_ids)

    def _apply_tokens(self, group: RequestGroup, seq: SequenceState, out: CoreOutput) -> bool:
        """A sample's new tokens, in order, up to a stop string; True when a stop string ended a sample that the
        core still runs. The core's finish comes with its last token: EOS or a stop token (whose text is not part
        of the output unless include_stop_str_in_output), length, or a finished grammar."""
        if not seq.token_ids:
            group.num_cached_tokens = out.num_cached_tokens
            if out.queue_time is not None and "queue_time" not in group.metrics:
                group.metrics["queue_time"] = out.queue_time
        last = len(out.new_token_ids) - 1
        for i, token in enumerate(out.new_token_ids):
            seq.token_ids.append(token)
            self.num_generation_tokens += 1
            lps = out.new_logprobs[i] if out.new_logprobs else None
            if seq.logprobs is not None and lps is not None:
                seq.logprobs.append(self.token_text.position(token, lps))
                seq.cumulative_logprob += lps.logprob
            on_stop_token = i == last and out.stopped_on_token
            if on_stop_token and not group.params.include_stop_str_in_output:
                stop_string = None  # as vLLM; it would show with skip_special_tokens=False (tool parsers' markers)
            else:
                stop_string = seq.detokenizer.add(token)  # it also extends the text
            core_status = out.finish_status if i == last else None
            # A stop token and length win over a stop string in the same token; a finished grammar does not.
            if stop_string is not None and not on_stop_token and core_status is not RequestStatus.FINISHED_LENGTH:
                seq.finish_reason, seq.stop_reason = RequestStatus.FINISHED_STOPPED.value, stop_string
                return core_status is None
            if core_status is not None:
                if stop_string is None:
                    seq.detokenizer.flush()
                seq.finish_reason, seq.stop_reason = core_status.value, out.stop_reason
        return False

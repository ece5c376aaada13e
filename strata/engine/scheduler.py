"""One token budget per step: running requests first (decodes or the rest of their prefill), then new
prefill chunks; recompute preemption when KV blocks run out. With speculative decoding a decode carries draft
tokens: extra tokens of the step with KV slots, of which only the verified ones count as computed. After a step
the scheduler appends the sampled tokens and decides EOS, stop tokens and length itself (check_stop)."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from strata.config import SchedulerConfig
from strata.engine.kv_cache import KVCacheManager
from strata.engine.request import CoreOutput, Request, RequestStatus
from strata.engine.speculative.decoder import SpeculativeDecoder
from strata.engine.state_cache import SlotPool
from strata.executor.model_runner import RunnerOutput
from strata.executor.step import NewRequestData, ScheduledRequest, SchedulerOutput
from strata.outputs import PromptLogprobsChunk, TokenLogprobs

logger = logging.getLogger(__name__)


class _Stop(NamedTuple):
    status: RequestStatus
    stop_token: int | None = None
    on_token: bool = False  # the last token is the EOS or stop token that ended the request


def check_stop(request: Request) -> tuple[RequestStatus, int | None] | None:
    """Whether the request's last token ends it, and the stop token id that did: EOS and stop_token_ids (once
    min_tokens are out) before length. Stop strings are the output side's (they need the text)."""
    token, params = request.token_ids[-1], request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in params.all_stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= request.max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def _core_output(request: Request, new: list[int], logprobs: list[TokenLogprobs] | None,
                 chunk: PromptLogprobsChunk | None, stop: _Stop | None) -> CoreOutput:
    queue_time = None if request.scheduled_time is None else request.scheduled_time - request.arrival_time
    return CoreOutput(request.request_id, new, logprobs[:len(new)] if logprobs and new else None, chunk,
                      None if stop is None else stop.status, None if stop is None else stop.stop_token,
                      stop is not None and stop.on_token, max(request.num_cached_tokens, 0), queue_time)


def _chunk_length(request: Request, start: int, n: int) -> int:
    """At most `n` tokens from `start`, never ending inside a span of tokens that attend to each other (a Gemma 3
    image): the chunk stops before such a span, or is empty (the request waits) when it starts in one it cannot
    finish. The config keeps max_num_batched_tokens above a span's length."""
    for first, end in getattr(request.mm_inputs, "bidirectional_spans", ()):
        if first < start + n < end:
            return first - start if first > start else 0
    return n


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, slots: SlotPool | None = None,
                 spec: SpeculativeDecoder | None = None, max_loras: int = 0) -> None:
        """`max_loras`: most LoRA adapters the running requests may use together (0: LoRA off)."""
        self.config = config
        self.max_loras = max_loras
        self.kv = kv
        self.slots = slots
        self.spec = spec
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        drafts = self._drafts()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            n = _chunk_length(request, start, min(request.num_tokens - start, budget))
            if request.in_flight or n <= 0:
                i += 1
                continue
            draft = drafts.get(request.request_id, [])[:budget - n]
            while not self.kv.allocate(request, n + len(draft)):
                if draft:  # drop the drafts before preempting anyone
                    draft = []
                    continue
                victim = self._pick_victim(request)
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                out.requests.append(self._scheduled(request, n, draft))
                budget -= n + len(draft)
                i += 1
        if not preempted:
            budget = self._admit_waiting(out, budget)
        return out

    def restore_finished(self, out: SchedulerOutput) -> None:
        """An unsent step's finished ids go out with the next step that is sent."""
        self._finished_ids = out.finished_request_ids + self._finished_ids

    def _pick_victim(self, request: Request) -> Request:
        # The most recently admitted request that is not in flight; possibly `request` itself.
        for victim in reversed(self.running):
            if not victim.in_flight or victim is request:
                return victim
        return request

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        # Requests whose adapter would make the running ones use more than max_loras wait (vLLM's rule), and those
        # behind them go first.
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if self.slots is not None and request.state_slot < 0 and self.slots.num_free == 0:
                break
            computed = self.kv.computed_blocks(request) if request.num_computed_tokens == 0 else []
            hit = len(computed) * self.kv.block_size
            n = _chunk_length(request, request.num_computed_tokens + hit,
                              min(request.num_tokens - request.num_computed_tokens - hit, budget))
            if n <= 0 or not self.kv.allocate(request, n, computed):
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit
                request.scheduled_time = time.monotonic()
            if self.slots is not None and request.state_slot < 0:
                request.state_slot = self.slots.take()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.requests.append(self._scheduled(request, n))
            budget -= n
            if lora is not None:
                loras.add(lora.lora_int_id)
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _drafts(self) -> dict[str, list[int]]:
        """Draft tokens for the running requests whose next step samples one token (none while speculation is
        off)."""
        if self.spec is None:
            return {}
        decoding = [r for r in self.running if not r.in_flight and r.num_tokens - r.num_computed_tokens == 1]
        return self.spec.drafts(decoding, len(self.running))

    def _scheduled(self, request: Request, n: int, draft: list[int] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        new = None
        if not request.known_to_workers:
            new = NewRequestData(request.sampling_params, request.prompt_token_ids, request.mm_inputs,
                                 request.lora_request)
            request.known_to_workers = True
        request.in_flight = True
        return ScheduledRequest(request.request_id, request.token_ids[start:start + n] + list(draft), start,
                                list(request.block_ids), start + n == request.num_tokens,
                                request.state_slot, new, len(draft))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        if self.slots is not None and request.state_slot >= 0:
            self.slots.release(request.state_slot)
            request.state_slot = -1

    def update(self, out: SchedulerOutput, result: RunnerOutput,
               grammar_ends: Callable[[Request, int], bool] | None = None) -> list[CoreOutput]:
        """Apply one step's results: append each request's new tokens up to the first that ends it (EOS, a stop
        token, its length, or `grammar_ends`, which feeds a token to the request's grammar and says whether that
        completes it), finish and free the ended requests at once, and report what changed. Of a request's draft
        tokens, those its new tokens confirm count as computed; the rest are forgotten (their KV slots are written
        again later, and the prefix cache only ever hashes blocks of verified tokens)."""
        outputs = []
        for s in out.requests:
            request = self.requests.get(s.request_id)
            if request is None:
                continue  # finished or aborted while in flight
            request.in_flight = False
            new, stop = [], None
            # A request preempted while in flight is recomputed: this step's tokens are not its own any more.
            if request.status is RequestStatus.RUNNING and request.num_computed_tokens == s.num_computed_tokens:
                tokens = result.sampled.get(s.request_id) if s.sample else None
                new, stop = self._advance(request, s, tokens or [], grammar_ends)
            chunk = result.prompt_logprobs.get(s.request_id)
            if new or chunk is not None:
                outputs.append(_core_output(request, new, result.logprobs.get(s.request_id), chunk, stop))
            if stop is not None:
                request.stop_reason = stop.stop_token
                self.finish(request, stop.status)
        return outputs

    def _advance(self, request: Request, s: ScheduledRequest, tokens: list[int],
                 grammar_ends: Callable[[Request, int], bool] | None) -> tuple[list[int], _Stop | None]:
        """Count a step's computed tokens and append its sampled ones up to the first that ends the request; returns
        the tokens appended and why the request ended, if it did."""
        accepted = len(tokens) - 1 if tokens and s.num_draft_tokens else 0
        request.num_computed_tokens += len(s.token_ids) - s.num_draft_tokens + accepted
        if s.num_draft_tokens and self.spec is not None:
            self.spec.record(s.num_draft_tokens, accepted)
        stop = None
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            by_token = check_stop(request)
            if by_token is not None:
                stop = _Stop(*by_token, on_token=by_token[0] is RequestStatus.FINISHED_STOPPED)
            elif grammar_ends is not None and grammar_ends(request, token):
                stop = _Stop(RequestStatus.FINISHED_STOPPED)
            if stop is not None:  # accepted draft tokens after it are not part of the output
                tokens = tokens[:i + 1]
                break
        self.kv.cache_full_blocks(request)
        return tokens, stop

    def finish(self, request: Request, status: RequestStatus) -> None:
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._release(request)
        if self.spec is not None:
            self.spec.finish(request)
        self._finished_ids.append(request.request_id)
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

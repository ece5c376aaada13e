"""One token budget per step: running requests first (decodes or the rest of their prefill), then new
prefill chunks; recompute preemption when KV blocks run out. With speculative decoding a decode carries draft
tokens: extra tokens of the step with KV slots, of which only the verified ones count as computed."""
from __future__ import annotations

import logging
import time
from collections import deque

from strata.config import SchedulerConfig
from strata.engine.kv_cache import KVCacheManager
from strata.engine.request import Request, RequestStatus
from strata.engine.speculative.decoder import SpeculativeDecoder
from strata.engine.state_cache import SlotPool
from strata.executor.step import NewRequestData, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, slots: SlotPool | None = None,
                 spec: SpeculativeDecoder | None = None) -> None:
        self.config = config
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
            n = min(request.num_tokens - request.num_computed_tokens, budget)
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.slots is not None and request.state_slot < 0 and self.slots.num_free == 0:
                break
            computed = self.kv.computed_blocks(request) if request.num_computed_tokens == 0 else []
            hit = len(computed) * self.kv.block_size
            n = min(request.num_tokens - request.num_computed_tokens - hit, budget)
            if not self.kv.allocate(request, n, computed):
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
            new = NewRequestData(request.sampling_params, request.prompt_token_ids, request.mm_inputs)
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

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Apply one step's results; returns the requests that got new tokens and how many (the engine decides
        whether a token stops a request, and calls `finish`, before the next step is scheduled). Of a request's
        draft tokens, those its new tokens confirm count as computed; the rest are forgotten (their KV slots are
        written again later, and the prefix cache only ever hashes blocks of verified tokens)."""
        changed = []
        for s in out.requests:
            request = self.requests.get(s.request_id)
            if request is None or request.finished:
                continue
            request.in_flight = False
            if request.status is not RequestStatus.RUNNING or request.num_computed_tokens != s.num_computed_tokens:
                continue  # preempted while in flight: it will be recomputed
            tokens = sampled.get(s.request_id) if s.sample else None
            accepted = len(tokens) - 1 if tokens and s.num_draft_tokens else 0
            request.num_computed_tokens += len(s.token_ids) - s.num_draft_tokens + accepted
            if s.num_draft_tokens and self.spec is not None:
                self.spec.record(s.num_draft_tokens, accepted)
            if tokens:
                request.token_ids.extend(tokens)
                changed.append((request, len(tokens)))
            self.kv.cache_full_blocks(request)
        return changed

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

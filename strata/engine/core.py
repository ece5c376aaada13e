"""EngineCore: the scheduler, the executor, grammars and the speculative decoder. Requests go in (CoreRequest),
each step's CoreOutputs (token ids, raw logprobs, finishes) come out; it knows no text."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from strata.config import EngineConfig
from strata.engine.grammars import GrammarState
from strata.engine.kv_cache import KVCacheManager
from strata.engine.request import CoreOutput, CoreRequest, Request, RequestStatus
from strata.engine.scheduler import Scheduler
from strata.engine.speculative.decoder import SpeculativeDecoder
from strata.engine.state_cache import SlotPool
from strata.errors import RequestError, StrataError
from strata.executor.executor import create_executor
from strata.executor.step import SchedulerOutput
from strata.lora.request import LoRARequest
from strata.reasoning import ReasoningParser

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Any, stop_token_ids: set[int],
                 reasoning: ReasoningParser | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer  # for grammars: which token is which text
        self.stop_token_ids = stop_token_ids
        self.reasoning = reasoning
        # Before the target loads: a draft model's configuration errors come first, and quickly.
        self.spec = None if config.speculative is None else SpeculativeDecoder(config.speculative, config)
        if self.spec is not None:
            self.spec.grammar_cut = self._grammar_cut
        self.executor = create_executor(config)
        kv = KVCacheManager(self.executor.num_kv_blocks, config.cache.block_size,
                            config.cache.enable_prefix_caching)
        slots = SlotPool(config.scheduler.max_num_seqs) if config.model.text_info.is_hybrid else None
        self.scheduler = Scheduler(config.scheduler, kv, slots, self.spec,
                                   0 if config.lora is None else config.lora.max_loras)
        self.in_flight: deque = deque()
        self.stats = {"prompt_tokens": 0, "steps": 0}
        self._grammar_state: GrammarState | None = None  # made on the first constrained request
        self._grammar_lock = threading.Lock()
        self.failures: list[tuple[str, StrataError]] = []  # requests that failed after add_request returned
        self.unloading_loras: set[int] = set()  # adapters removed while unfinished requests use them (pinned)

    @property
    def grammars(self) -> GrammarState:
        with self._grammar_lock:  # the server's threads may ask first
            if self._grammar_state is None:
                self._grammar_state = GrammarState(self.config, self.tokenizer, self.stop_token_ids, self.reasoning)
        return self._grammar_state

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def add_request(self, request: CoreRequest) -> None:
        """Queue one scheduler request per sample; under a grammar they wait for it outside the scheduler."""
        waiting = self._grammar_state is not None and request.request_id in self._grammar_state.waiting
        if waiting or any(i in self.scheduler.requests for i in request.sample_ids):
            raise RequestError(f"request id {request.request_id!r} is already running", param="request_id")
        prompt, lora = request.prompt, request.lora_request
        if lora is not None:  # loaded and checked now: a bad adapter is refused before anything is queued
            self.add_lora(lora)
        requests = [Request(sample_id, prompt.token_ids, params, self.max_model_len, request.arrival_time,
                            prompt.mm_inputs, lora) for sample_id, params in request.samples]
        if request.params.structured_outputs is not None:
            # Refused here when the schema is invalid.
            self.grammars.add(request.request_id, request.params.structured_outputs, requests, request.thinking)
        else:
            for r in requests:
                self.scheduler.add(r)

    def add_lora(self, lora: LoRARequest) -> None:
        """Load and check a LoRA adapter on every rank (refused with the reason)."""
        if self.config.lora is None:
            raise RequestError("this engine was started without enable_lora: it serves no LoRA adapters",
                               param="lora_request")
        self.executor.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter: its host copy and slot are freed now, or, while unfinished requests use it, kept in
        host memory (its folder may go) until the last of them ends (vLLM's unload: they finish with it)."""
        if self.config.lora is None:
            return
        if self._lora_in_use(lora_int_id):
            self.executor.pin_lora(lora_int_id)
            self.unloading_loras.add(lora_int_id)
        else:
            self.unloading_loras.discard(lora_int_id)
            self.executor.remove_lora(lora_int_id)

    def _lora_in_use(self, lora_int_id: int) -> bool:
        grammars = self._grammar_state
        waiting = [] if grammars is None else [r for _, _, group, _ in grammars.waiting.values() for r in group]
        return any(r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
                   for r in [*self.scheduler.requests.values(), *waiting])

    def _remove_unused_loras(self) -> None:
        """Remove the unloaded adapters whose last request ended (steps already submitted come first: the
        executor applies LoRA commands in step order)."""
        for lora_int_id in [i for i in self.unloading_loras if not self._lora_in_use(i)]:
            self.unloading_loras.discard(lora_int_id)
            self.executor.remove_lora(lora_int_id)

    def abort_requests(self, ids: Iterable[str]) -> None:
        """End requests now, whatever they are doing: scheduler request ids, or a user request's id while its
        samples wait for their grammar."""
        self.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        """End requests the output side finished (a stop string): their blocks and slots are free at once; tokens
        already on their way are dropped there."""
        for request_id in ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, status)
            if self._grammar_state is not None:
                self._grammar_state.drop(request_id)
        if self.unloading_loras:
            self._remove_unused_loras()

    def has_unfinished_requests(self) -> bool:
        grammars = self._grammar_state
        return self.scheduler.has_unfinished or bool(self.in_flight) or bool(grammars is not None and
                                                                              grammars.waiting)

    def step(self) -> list[CoreOutput]:
        """Run one batch (keeping up to the executor's limit in flight); returns what it did to each request."""
        grammars = self._grammar_state
        if grammars is not None:
            self._admit_grammar_requests(grammars)
        while len(self.in_flight) < self.executor.max_concurrent_batches:
            started = time.perf_counter()
            sched = self.scheduler.schedule()
            if sched.empty:
                self.scheduler.restore_finished(sched)
                break
            if grammars is not None:
                sched.grammar_bitmask = grammars.bitmask(sched)
            self.in_flight.append((sched, self.executor.submit(sched), started))
        if not self.in_flight:
            if grammars is not None:
                grammars.wait(0.01)
            return []
        sched, handle, started = self.in_flight.popleft()
        result = self.executor.collect(handle)
        self.stats["steps"] += 1
        outputs = self.scheduler.update(sched, result, None if grammars is None else self._grammar_ends)
        if grammars is not None:
            for out in outputs:
                if out.finished:
                    grammars.drop(out.request_id)
        sampled = sum(1 for out in outputs if out.new_token_ids)
        self.stats["prompt_tokens"] += sched.num_tokens - sched.num_draft_tokens - sampled
        if self.spec is not None:
            self._time_step(sched, time.perf_counter() - started)
        if self.unloading_loras:
            self._remove_unused_loras()
        return outputs

    def _grammar_ends(self, request: Request, token: int) -> bool:
        """Feed a new token to the request's grammar (if it has one); True when that completes it."""
        return self._grammar_state.accept(request.request_id, token)

    def _admit_grammar_requests(self, grammars: GrammarState) -> None:
        admitted, failed = grammars.ready()
        for request in admitted:
            self.scheduler.add(request)
        for request_id, error in failed:
            grammars.drop(request_id)
            self.failures.append((request_id, error))

    def _time_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """A decode or verification step's time, for the depth of later drafts: all the engine spends on it, from
        proposing the drafts and scheduling to the outputs (the Python around a draft token costs like the forward's
        share of it on a small CPU model). Only while one step at a time is in flight: with pipeline stages
        overlapping, a step's time is not its own."""
        if self.executor.max_concurrent_batches == 1 and all(
                s.sample and len(s.token_ids) == s.num_draft_tokens + 1 for s in sched.requests):
            self.spec.observe_step(sched.num_tokens, seconds)

    def _grammar_cut(self, request: Request, draft: list[int]) -> list[int]:
        """A draft cut before the first token the request's grammar refuses (unconstrained: the whole draft)."""
        grammars = self._grammar_state
        if grammars is None or not grammars.constrained(request.request_id):
            return draft
        return grammars.valid_prefix(request.request_id, draft)

    def take_failures(self) -> list[tuple[str, StrataError]]:
        """User requests refused after add_request returned (a grammar that failed or timed out compiling)."""
        failures, self.failures = self.failures, []
        return failures

    def snapshot(self) -> dict[str, Any]:
        """Scheduler, KV cache and step counters, for the stats log line, /metrics and /get_load."""
        sched, kv = self.scheduler, self.scheduler.kv
        return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_usage": kv.usage,
                "prefix_queries": kv.prefix_queries, "prefix_hits": kv.prefix_hits,
                "num_preemptions": sched.num_preemptions,
                "free_blocks": kv.pool.num_free, "total_blocks": kv.pool.num_blocks,
                "spec_decode": None if self.spec is None else self.spec.stats.copy(), **self.stats}

    def check_health(self) -> None:
        """Raise if a worker died (the engine loop calls this while idle, when no step would notice)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        if self._grammar_state is not None:
            self._grammar_state.shutdown()
        self.executor.shutdown()

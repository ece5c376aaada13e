"""Engine: add_request / abort_request / step over the scheduler and an executor."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from strata.config import EngineConfig
from strata.engine.grammars import GrammarState
from strata.engine.kv_cache import KVCacheManager
from strata.engine.output_processor import RequestGroup, SequenceState, TokenTextCache, stop_condition
from strata.engine.request import ProcessedPrompt, Request, RequestStatus
from strata.engine.scheduler import Scheduler
from strata.engine.speculative.decoder import SpeculativeDecoder
from strata.engine.state_cache import SlotPool
from strata.errors import RequestError, StrataError
from strata.executor.executor import create_executor
from strata.executor.model_runner import RunnerOutput
from strata.executor.step import SchedulerOutput
from strata.multimodal.chat import ImagePromptProcessor, render_chat
from strata.outputs import Logprob, PromptLogprobsChunk, RequestOutput
from strata.reasoning import reasoning_parser
from strata.sampling_params import SamplingParams
from strata.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.tokenizer_gguf_file)
        self.reasoning = reasoning_parser(config.structured.reasoning_parser, self.tokenizer)
        self.mm_processor = ImagePromptProcessor.for_model(config.model, self.tokenizer)
        # Before the target loads: a draft model's configuration errors come first, and quickly.
        self.spec = None if config.speculative is None else SpeculativeDecoder(config.speculative, config)
        if self.spec is not None:
            self.spec.grammar_cut = self._grammar_cut
        self.executor = create_executor(config)
        kv = KVCacheManager(self.executor.num_kv_blocks, config.cache.block_size,
                            config.cache.enable_prefix_caching)
        slots = SlotPool(config.scheduler.max_num_seqs) if config.model.text_info.is_hybrid else None
        self.scheduler = Scheduler(config.scheduler, kv, slots, self.spec)
        self.groups: dict[str, RequestGroup] = {}
        self.sequence_of: dict[str, tuple[RequestGroup, SequenceState]] = {}
        self.in_flight: deque = deque()
        self.token_text = TokenTextCache(self.tokenizer)
        self.stop_token_ids = set(config.model.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.stop_token_ids.add(self.tokenizer.eos_token_id)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self._grammar_state: GrammarState | None = None  # made on the first constrained request
        self._grammar_lock = threading.Lock()
        self.failures: list[tuple[str, StrataError]] = []  # requests that failed after add_request returned

    @property
    def grammars(self) -> GrammarState:
        with self._grammar_lock:  # the server's threads may ask first
            if self._grammar_state is None:
                self._grammar_state = GrammarState(self.config, self.tokenizer, self.stop_token_ids, self.reasoning)
        return self._grammar_state

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def process_prompt(self, prompt: PromptInput | ProcessedPrompt, truncate_prompt_tokens: int | None = None,
                       truncation_side: str = "left") -> ProcessedPrompt:
        """Tokenize, attach images and validate: the one place a prompt is checked on its way in.
        `truncate_prompt_tokens` keeps that many tokens (-1: the context length) from `truncation_side`'s
        opposite end, as vLLM's completions do; the text of a truncated prompt is dropped."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text, token_ids, mm = self._tokenize(prompt)
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            token_ids = (token_ids[:keep] if truncation_side == "right"
                         else token_ids[len(token_ids) - min(keep, len(token_ids)):])
            text = None
        if mm is not None:
            if self.mm_processor is None:
                raise RequestError("this model is text-only and cannot take multi_modal_data",
                                   param="multi_modal_data")
            token_ids, mm = self.mm_processor.attach(token_ids, mm)
        return self._validated(ProcessedPrompt(text, token_ids, mm))

    def render_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, *, template_kwargs: dict[str, Any] | None = None,
                    allowed_local_media_path: str | None = None, allow_remote_media: bool = False,
                    validate: bool = True) -> ProcessedPrompt:
        """One conversation through the chat template (the configured one unless given), its images loaded,
        tiled and expanded into placeholder ids; validated like any prompt unless `validate` is False (for
        /tokenize, which counts the tokens of any conversation)."""
        chat = render_chat(self.tokenizer, messages, self.mm_processor, chat_template or self.config.chat_template,
                           add_generation_prompt, allowed_local_media_path=allowed_local_media_path,
                           allow_remote_media=allow_remote_media, **(template_kwargs or {}))
        prompt = ProcessedPrompt(chat.text, chat.token_ids, chat.mm_inputs, template_kwargs)
        return self._validated(prompt) if validate else prompt

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int], Any]:
        mm = None
        if isinstance(prompt, dict):
            mm = prompt.get("multi_modal_data")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), mm
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids, mm
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), mm
        raise RequestError("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                           "'prompt_token_ids'", param="prompt")

    def _validated(self, prompt: ProcessedPrompt) -> ProcessedPrompt:
        token_ids = prompt.token_ids
        if not token_ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(token_ids)} tokens (at least one token must be left to generate)", param="prompt")
        vocab = self.config.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        return prompt

    def add_request(self, request_id: str, prompt: PromptInput | ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request; a raw prompt is processed here, a ProcessedPrompt is taken as it is."""
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already running", param="request_id")
        prompt = self.process_prompt(prompt)
        params = params.clone()
        params.all_stop_token_ids = set(self.stop_token_ids)
        group = RequestGroup(request_id, prompt.text, prompt.token_ids, params, self.tokenizer)
        requests = [Request(seq.request_id, prompt.token_ids, group.child_params(seq.index), self.max_model_len,
                            arrival_time, prompt.mm_inputs) for seq in group.sequences]
        if params.structured_outputs is not None:
            # Waits for its grammar outside the scheduler; refused here when the schema is invalid. A thinking
            # output is constrained from the end of its thinking on.
            thinking = self.reasoning is not None and self.reasoning.thinks_first(prompt.token_ids,
                                                                                  prompt.chat_template_kwargs)
            self.grammars.add(request_id, params.structured_outputs, requests, thinking)
        else:
            for request in requests:
                self.scheduler.add(request)
        self.groups[request_id] = group
        for seq in group.sequences:
            self.sequence_of[seq.request_id] = (group, seq)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.sequences:
            self.sequence_of.pop(seq.request_id, None)
            self.scheduler.abort(seq.request_id)
        if self._grammar_state is not None:
            self._grammar_state.drop(request_id)
            for seq in group.sequences:
                self._grammar_state.drop(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        """Run one batch (keeping up to the executor's limit in flight); returns updated requests."""
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
        result: RunnerOutput = self.executor.collect(handle)
        self.stats["steps"] += 1
        changed = self.scheduler.update(sched, result.sampled)
        touched: dict[str, RequestGroup] = {}
        for request, count in changed:
            self._apply_tokens(request, count, result.logprobs.get(request.request_id), touched)
        for request_id, entries in result.prompt_logprobs.items():
            self._apply_prompt_logprobs(request_id, entries, touched)
        self.stats["prompt_tokens"] += sched.num_tokens - sched.num_draft_tokens - len(changed)
        outputs = self._collect_outputs(touched)
        if self.spec is not None:
            self._time_step(sched, time.perf_counter() - started)
        return outputs

    def _admit_grammar_requests(self, grammars: GrammarState) -> None:
        admitted, failed = grammars.ready()
        for request in admitted:
            self.scheduler.add(request)
        for request_id, error in failed:
            self.abort_request(request_id)
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
        """Requests refused after add_request returned (a grammar that failed or timed out compiling)."""
        failures, self.failures = self.failures, []
        return failures

    def _apply_tokens(self, request: Request, count: int, logprobs: list | None, touched: dict) -> None:
        """A request's `count` new tokens (the last of its token_ids) in order, up to the first that ends it: a
        verification step's tokens after a stop are dropped."""
        for i in range(count):
            self._apply_token(request, logprobs[i] if logprobs else None, count - 1 - i, touched)
            if request.finished:
                return

    def _apply_token(self, request: Request, lps: Any, pending: int, touched: dict) -> None:
        """The new token `pending` places before the end of the request's token_ids."""
        found = self.sequence_of.get(request.request_id)
        if found is None:  # not expected (abort_request drops both together), but never leave it running
            self.scheduler.abort(request.request_id)
            return
        group, seq = found
        token = request.token_ids[-1 - pending]
        self.stats["generation_tokens"] += 1
        seq.token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            group.num_cached_tokens = max(request.num_cached_tokens, 0)
            if request.scheduled_time is not None and "queue_time" not in group.metrics:
                group.metrics["queue_time"] = request.scheduled_time - request.arrival_time
        if seq.logprobs is not None and lps is not None:
            seq.logprobs.append(self.token_text.position(token, lps))
            seq.cumulative_logprob += lps.logprob
        stop = stop_condition(request, None, pending)
        if stop is not None and stop[0] is RequestStatus.FINISHED_STOPPED and \
                not request.sampling_params.include_stop_str_in_output:
            # The text of the EOS or stop token that ended the output is not part of it (as vLLM); it would show
            # with skip_special_tokens=False, which tool parsers whose markers are special tokens need.
            stop_string = None
        else:
            stop_string = seq.detokenizer.add(token)  # it also extends the text
            stop = stop or stop_condition(request, stop_string, pending)
        if self._grammar_state is not None and self._grammar_state.constrained(request.request_id):
            if self._grammar_state.accept(request.request_id, token) and stop is None:
                stop = (RequestStatus.FINISHED_STOPPED, None)  # the grammar is complete
            if stop is not None:
                self._grammar_state.drop(request.request_id)
        if stop is not None:
            if stop_string is None:
                seq.detokenizer.flush()
            request.stop_reason = stop[1]
            if pending:  # tokens after the stop (accepted drafts) are not part of the output
                del request.token_ids[-pending:]
            self.scheduler.finish(request, stop[0])
            seq.finish_reason, seq.stop_reason = request.status.value, request.stop_reason
        touched[group.request_id] = group

    def _apply_prompt_logprobs(self, request_id: str, chunk: PromptLogprobsChunk, touched: dict) -> None:
        found = self.sequence_of.get(request_id)
        if found is None or found[1].index != 0 or found[0].prompt_logprobs is None:
            return
        group = found[0]
        for position, lps in enumerate(chunk.positions, chunk.start):
            group.prompt_logprobs[position] = self.token_text.position(group.prompt_token_ids[position], lps)
        touched[group.request_id] = group

    def _collect_outputs(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        outputs = []
        for group in touched.values():
            outputs.append(group.output())
            if group.finished:
                self.groups.pop(group.request_id, None)
                for seq in group.sequences:
                    self.sequence_of.pop(seq.request_id, None)
        return outputs

    def snapshot(self) -> dict[str, Any]:
        """Scheduler, KV cache and token counters, for the stats log line, /metrics and /get_load."""
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


__all__ = ["Engine", "Logprob", "ProcessedPrompt", "PromptInput"]

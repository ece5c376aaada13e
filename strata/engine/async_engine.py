"""AsyncEngine: one background thread steps the Engine; asyncio callers stream their outputs."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from strata.config import EngineConfig
from strata.engine.engine import Engine, PromptInput
from strata.engine.request import ProcessedPrompt
from strata.errors import EngineDeadError, StrataError
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams
from strata.structured.grammar import result_of

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 5.0


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self.tokenizer = engine.tokenizer
        self.reasoning = engine.reasoning  # the --reasoning-parser, bound to the tokenizer, or None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def stats(self) -> dict[str, Any]:
        return self.engine.snapshot()

    def process_prompt(self, prompt: PromptInput | ProcessedPrompt, truncate_prompt_tokens: int | None = None,
                       truncation_side: str = "left") -> ProcessedPrompt:
        """Tokenize and validate in the caller, so a bad prompt fails before any streaming starts."""
        return self.engine.process_prompt(prompt, truncate_prompt_tokens, truncation_side)

    def render_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> ProcessedPrompt:
        """A conversation as a validated prompt (see Engine.render_chat), rendered in the caller."""
        return self.engine.render_chat(messages, chat_template, add_generation_prompt, **kwargs)

    async def prepare_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (or find it cached) before the request is queued, so that an invalid or
        too slow grammar is a 400 before any streaming; the step loop runs on meanwhile."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        future = self.engine.grammars.compiler.submit(constraint)
        timeout_s = self.config.structured.timeout_s
        await asyncio.get_running_loop().run_in_executor(None, result_of, future, constraint, timeout_s)

    async def generate(self, request_id: str, prompt: PromptInput | ProcessedPrompt, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of one request until it finishes; leaving early aborts it."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        prompt = self.process_prompt(prompt)
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", request_id, prompt, params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def fail_all(self, error: StrataError) -> int:
        """End every running request with `error` (each stream raises it, which aborts the request); returns
        how many there were. A draining server calls this when its time is up."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, error)
        return len(request_ids)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                continue
            _, request_id, prompt, params = command
            try:
                self.engine.add_request(request_id, prompt, params)
            except StrataError as e:
                self._deliver(request_id, e)

    def _loop(self) -> None:
        last_log = time.monotonic()
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()  # a worker may die while the engine is idle
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                for request_id, error in self.engine.take_failures():
                    self._deliver(request_id, error)
                if time.monotonic() - last_log > _STATS_INTERVAL_S:
                    last_log = time.monotonic()
                    s = self.stats()
                    logger.info("running %d, waiting %d, KV usage %.1f%%, %d prompt and %d generated tokens",
                                s["running"], s["waiting"], 100 * s["kv_usage"], s["prompt_tokens"],
                                s["generation_tokens"])
                    spec = self.engine.spec.interval_summary() if self.engine.spec is not None else None
                    if spec is not None:
                        logger.info("%s", spec)
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, and every caller hears of it
            logger.exception("engine loop failed")
            self.dead_error = e
            error = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
            with self._lock:
                request_ids = list(self._streams)
            for request_id in request_ids:
                self._deliver(request_id, error)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

"""AsyncEngine: the engine's three parts across threads. Callers (the server's asyncio loop) process their input and
register with the output side in their own thread; one thread only steps the core; another processes the core's
outputs and delivers them to the callers' streams, and sends a stop string's finish back through the command queue."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from strata.config import EngineConfig
from strata.engine.core import EngineCore
from strata.engine.input_processor import InputProcessor, PromptInput
from strata.engine.output_processor import OutputProcessor
from strata.engine.request import ProcessedPrompt
from strata.errors import EngineDeadError, StrataError
from strata.lora.request import LoRARequest
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams
from strata.structured.grammar import result_of

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 5.0


class AsyncEngine:
    def __init__(self, input_processor: InputProcessor, core: EngineCore, output_processor: OutputProcessor) -> None:
        self.input, self.core, self.output = input_processor, core, output_processor
        self.config: EngineConfig = core.config
        self.tokenizer = input_processor.tokenizer
        self.reasoning = input_processor.reasoning  # the --reasoning-parser, bound to the tokenizer, or None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # to the core thread: add, abort, finish
        self._core_outputs: queue.SimpleQueue = queue.SimpleQueue()  # to the output thread; None stops it
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # the streams
        # The output processor: its thread processes outputs, callers add and abort requests.
        self._output_lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self._stopping = False
        self._core_thread = threading.Thread(target=self._core_loop, name="strata-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="strata-output", daemon=True)
        self._core_thread.start()
        self._output_thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        inputs = InputProcessor(config)
        core = EngineCore(config, inputs.tokenizer, inputs.stop_token_ids, inputs.reasoning)
        return cls(inputs, core, OutputProcessor(inputs.tokenizer))

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def stats(self) -> dict[str, Any]:
        """Scheduler, KV cache and token counters, for the stats log line, /metrics and /get_load."""
        return {**self.core.snapshot(), "generation_tokens": self.output.num_generation_tokens}

    async def prepare_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (or find it cached) before the request is queued, so that an invalid or
        too slow grammar is a 400 before any streaming; the step loop runs on meanwhile."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        future = self.core.grammars.compiler.submit(constraint)
        timeout_s = self.config.structured.timeout_s
        await asyncio.get_running_loop().run_in_executor(None, result_of, future, constraint, timeout_s)

    async def generate(self, request_id: str, prompt: PromptInput | ProcessedPrompt, params: SamplingParams,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of one request (with its LoRA adapter, if any) until it finishes; leaving early
        aborts it."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        request = self.input.make_request(request_id, prompt, params, lora_request=lora_request)
        with self._output_lock:
            self.output.add_request(request)  # before the core can make outputs for it; refuses a duplicate id
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request))
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

    def call_in_core(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the core thread between steps (what touches the core's state must); its result or
        exception lands in the returned future."""
        if self.dead_error is not None or self._stopping:
            raise EngineDeadError(f"the engine is dead: {self.dead_error or 'shut down'}")
        future: Future = Future()
        self._send(("call", (fn, args, future)))
        return future

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a LoRA adapter on the core thread (refused with the reason)."""
        await asyncio.wrap_future(self.call_in_core(self.core.add_lora, lora_request))

    async def remove_lora(self, lora_int_id: int) -> None:
        await asyncio.wrap_future(self.call_in_core(self.core.remove_lora, lora_int_id))

    def fail_all(self, error: StrataError) -> int:
        """End every running request with `error` (each stream raises it, which aborts the request); returns
        how many there were. A draining server calls this when its time is up."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, error)
        return len(request_ids)

    def abort(self, request_id: str) -> None:
        with self._output_lock:
            ids = self.output.abort_request(request_id)
        self._send(("abort", ids))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
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
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.core.abort_requests(arg)
            elif kind == "finish":
                self.core.finish_requests(arg)
            elif kind == "call":
                _run_call(*arg)
            else:
                try:
                    self.core.add_request(arg)
                except StrataError as e:
                    self._core_outputs.put(([], [(arg.request_id, e)]))

    def _core_loop(self) -> None:
        """The core thread: commands in, steps, CoreOutputs handed to the output thread; nothing else."""
        last_log = time.monotonic()
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.core.has_unfinished_requests():
                    self.core.check_health()  # a worker may die while the engine is idle
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.core.step()
                failures = self.core.take_failures()
                if outputs or failures:
                    self._core_outputs.put((outputs, failures))
                if time.monotonic() - last_log > _STATS_INTERVAL_S:
                    last_log = time.monotonic()
                    self._log_stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, and every caller hears of it
            self._die(e, "engine loop failed")

    def _output_loop(self) -> None:
        """The output thread: detokenize, find stop strings, deliver; stop-string finishes go back to the core."""
        try:
            while True:
                item = self._core_outputs.get()
                if item is None:
                    return
                outputs, failures = item
                with self._output_lock:
                    processed = self.output.process_outputs(outputs)
                    for request_id, _ in failures:
                        self.output.abort_request(request_id)
                if processed.finished_ids:
                    self._send(("finish", processed.finished_ids))
                for out in processed.request_outputs:
                    self._deliver(out.request_id, out)
                for request_id, error in failures:
                    self._deliver(request_id, error)
        except BaseException as e:  # noqa: BLE001 - as in the core thread
            self._die(e, "output processing failed")

    def _log_stats(self) -> None:
        s = self.stats()
        logger.info("running %d, waiting %d, KV usage %.1f%%, %d prompt and %d generated tokens",
                    s["running"], s["waiting"], 100 * s["kv_usage"], s["prompt_tokens"], s["generation_tokens"])
        spec = self.core.spec.interval_summary() if self.core.spec is not None else None
        if spec is not None:
            logger.info("%s", spec)

    def _die(self, e: BaseException, what: str) -> None:
        logger.exception(what)
        if self.dead_error is None:
            self.dead_error = e
        self._stopping = True  # the other thread stops too
        self._wake.set()
        self._core_outputs.put(None)
        error = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, error)
        self._fail_calls(error)

    def _fail_calls(self, error: EngineDeadError) -> None:
        """Calls queued for the core thread (adapter loads) get the engine's death instead of waiting forever."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call" and not arg[2].done():
                arg[2].set_exception(error)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._core_thread.join(timeout=10)
        self._core_outputs.put(None)
        self._output_thread.join(timeout=10)
        self.core.shutdown()


def _run_call(fn: Callable[..., Any], args: tuple, future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)
        if not isinstance(e, StrataError):  # a StrataError is the caller's (a bad adapter); others kill the engine
            raise

"""Engine: the synchronous facade over the three parts (input processing -> core -> output processing) in one
thread, for LLM and the benches; AsyncEngine (async_engine.py) composes the same parts across threads."""
from __future__ import annotations

from typing import Any

from strata.config import EngineConfig
from strata.engine.core import EngineCore
from strata.engine.grammars import GrammarState
from strata.engine.input_processor import InputProcessor, PromptInput
from strata.engine.output_processor import OutputProcessor
from strata.engine.request import ProcessedPrompt
from strata.engine.scheduler import Scheduler
from strata.engine.speculative.decoder import SpeculativeDecoder
from strata.errors import StrataError
from strata.lora.request import LoRARequest
from strata.outputs import Logprob, RequestOutput
from strata.sampling_params import SamplingParams


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.input = InputProcessor(config)
        self.core = EngineCore(config, self.input.tokenizer, self.input.stop_token_ids, self.input.reasoning)
        self.output = OutputProcessor(self.input.tokenizer)

    # What callers read of the parts (benches and tests): the parts own them.
    @property
    def tokenizer(self) -> Any:
        return self.input.tokenizer

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def executor(self) -> Any:
        return self.core.executor

    @property
    def spec(self) -> SpeculativeDecoder | None:
        return self.core.spec

    @property
    def grammars(self) -> GrammarState:
        return self.core.grammars

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def stats(self) -> dict[str, int]:
        """Prompt and generated tokens and steps so far."""
        return {**self.core.stats, "generation_tokens": self.output.num_generation_tokens}

    def process_prompt(self, prompt: PromptInput | ProcessedPrompt, truncate_prompt_tokens: int | None = None,
                       truncation_side: str = "left") -> ProcessedPrompt:
        return self.input.process_prompt(prompt, truncate_prompt_tokens, truncation_side)

    def add_request(self, request_id: str, prompt: PromptInput | ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request (with its LoRA adapter, if any); a raw prompt is processed here, a ProcessedPrompt is
        taken as it is."""
        request = self.input.make_request(request_id, prompt, params, arrival_time, lora_request)
        self.output.add_request(request)  # refuses a duplicate id before the core sees it
        try:
            self.core.add_request(request)
        except BaseException:
            self.output.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One core step, its outputs processed; samples a stop string ended are finished in the core at once."""
        processed = self.output.process_outputs(self.core.step())
        if processed.finished_ids:
            self.core.finish_requests(processed.finished_ids)
        return processed.request_outputs

    def take_failures(self) -> list[tuple[str, StrataError]]:
        """Requests refused after add_request returned (a grammar that failed or timed out compiling)."""
        failures = self.core.take_failures()
        for request_id, _ in failures:
            self.output.abort_request(request_id)
        return failures

    def snapshot(self) -> dict[str, Any]:
        """Scheduler, KV cache and token counters, for the stats log line, /metrics and /get_load."""
        return {**self.core.snapshot(), "generation_tokens": self.output.num_generation_tokens}

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()


__all__ = ["Engine", "Logprob", "ProcessedPrompt", "PromptInput"]

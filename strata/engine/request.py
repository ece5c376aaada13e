"""What passes between the engine's three parts: a request on its way in (ProcessedPrompt, then CoreRequest), as
the scheduler sees it (Request: its tokens, how many are computed, its blocks and its state slot), and what the core
reports of it after a step (CoreOutput)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from strata.lora.request import LoRARequest
from strata.outputs import PromptLogprobsChunk, TokenLogprobs
from strata.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt tokenized and validated once (Engine.process_prompt or Engine.render_chat), then passed down
    unchanged: the server checks it before streaming, the engine thread queues it as it is."""

    text: str | None
    token_ids: list[int]
    mm_inputs: Any = None  # model-specific multimodal inputs (e.g. image tiles), or None
    # The keywords a chat prompt's template was rendered with (a reasoning parser reads enable_thinking), or None.
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class CoreRequest:
    """One user request as input processing hands it to the core and to output processing: n > 1 is fanned out here
    into one sample per scheduler request, each with its own id and parameters (its own seed)."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams  # the user's, with the model's stop token ids
    samples: tuple[tuple[str, SamplingParams], ...]  # (scheduler request id, its parameters) per sample
    arrival_time: float
    thinking: bool = False  # the outputs start with thinking, which a grammar leaves free
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    @property
    def sample_ids(self) -> list[str]:
        return [sample_id for sample_id, _ in self.samples]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_model_len: int, arrival_time: float | None = None, mm_inputs: object = None,
                 lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.token_ids = list(prompt_token_ids)  # prompt, then every generated token
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_model_len = max_model_len
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.mm_inputs = mm_inputs  # model-specific multimodal inputs (e.g. image tiles), or None
        self.lora_request = lora_request  # its LoRA adapter, or None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        self.num_hashed_blocks_cached = 0  # how many of block_ids are registered in the prefix cache
        self.state_slot = -1
        self.in_flight = False  # part of a batch whose output has not come back (pipeline parallel)
        self.known_to_workers = False
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission
        self.stop_reason: int | None = None  # the stop token id that ended it, if one did
        self.scheduled_time: float | None = None  # first admission to the running batch

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        """Generated tokens allowed: the request's max_tokens, capped by the context length."""
        room = self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class CoreOutput:
    """What one step did to one scheduler request: its new tokens (none after the one that ended it), their raw
    logprobs, a chunk of prompt logprobs, and whether and why the core finished it."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: PromptLogprobsChunk | None = None
    finish_status: RequestStatus | None = None
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS, length or a finished grammar)
    # The last new token is the EOS or stop token that ended the request (its text is left out of the output unless
    # include_stop_str_in_output); False for length and for a finished grammar.
    stopped_on_token: bool = False
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    queue_time: float | None = None  # seconds from arrival to first scheduled

    @property
    def finished(self) -> bool:
        return self.finish_status is not None

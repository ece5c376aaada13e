"""A request on its way in (ProcessedPrompt), then as the scheduler sees it: its tokens, how many are computed,
its blocks and its state slot."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

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
                 max_model_len: int, arrival_time: float | None = None, mm_inputs: object = None) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.token_ids = list(prompt_token_ids)  # prompt, then every generated token
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_model_len = max_model_len
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.mm_inputs = mm_inputs  # model-specific multimodal inputs (e.g. image tiles), or None
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
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
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

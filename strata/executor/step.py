"""What one step asks of the executor: the scheduler builds a SchedulerOutput, every rank's runner consumes it.

These types live below the engine so that the executor never imports the scheduler.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from strata.lora.request import LoRARequest
from strata.sampling_params import SamplingParams


class GrammarBitmask:
    """Which tokens each constrained row may sample this step: int32 words, bit t of row i allows token t.
    The engine may still be filling it (a Future) while the forward runs; pickling it for other ranks waits."""

    def __init__(self, request_ids: list[str], bits: torch.Tensor | Future) -> None:
        self.request_ids = request_ids
        self._bits = bits

    def tensor(self) -> torch.Tensor:
        if isinstance(self._bits, Future):
            self._bits = self._bits.result()
        return self._bits

    def __getstate__(self) -> dict:
        return {"request_ids": self.request_ids, "_bits": self.tensor()}


@dataclass
class NewRequestData:
    """What a worker needs the first time it sees a request."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    mm_inputs: object = None
    lora_request: LoRARequest | None = None  # the adapter its rows run with (None: the base model)


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens fed this step
    num_computed_tokens: int  # tokens already in the cache before this step
    block_ids: list[int]
    sample: bool  # this step reaches the last known token, so the next one is sampled
    state_slot: int = -1
    new: NewRequestData | None = None
    # Speculative decoding: the last `num_draft_tokens` of token_ids are draft tokens to verify; the step samples
    # a token at every position from the last known token on and keeps those the drafts lead to.
    num_draft_tokens: int = 0
    # Tokens that continue a sequence a few at a time (a draft model catching up on verified tokens): laid out as
    # decode rows like a verification step's, only the last row sampled.
    catch_up: bool = False

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else []


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: GrammarBitmask | None = None  # rows of the requests that sample under a grammar

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def num_draft_tokens(self) -> int:
        return sum(r.num_draft_tokens for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class PoolingStep:
    """A batch of whole prompts for the pooling runner, which every rank runs: `task` "embed" ([B, hidden] vectors)
    or "classify" ([B, num_labels] logits; `token_types`: the segment ids of pair inputs)."""

    task: str
    sequences: list[list[int]]
    token_types: list[list[int]] | None = None

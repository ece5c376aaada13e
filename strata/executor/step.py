"""What one step asks of the executor: the scheduler builds a SchedulerOutput, every rank's runner consumes it.

These types live below the engine so that the executor never imports the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from strata.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """What a worker needs the first time it sees a request."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    mm_inputs: object = None


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens fed this step
    num_computed_tokens: int  # tokens already in the cache before this step
    block_ids: list[int]
    sample: bool  # this step reaches the last known token, so the next one is sampled
    state_slot: int = -1
    new: NewRequestData | None = None


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests

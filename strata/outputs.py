"""What generation returns: RequestOutput with one CompletionOutput per sample, and logprobs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenLogprobs(NamedTuple):
    """What the sampler reports for one position: the top-k alternatives, then the chosen token's logprob and
    its 1-based rank in the whole vocabulary."""

    top_ids: list[int]
    top_logprobs: list[float]
    logprob: float
    rank: int


class PromptLogprobsChunk(NamedTuple):
    """Logprobs of the prompt tokens at positions start, start + 1, ... computed in one step."""

    start: int
    positions: list[TokenLogprobs]


# One dict per position: token id -> Logprob (the sampled token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per input, shaped as vLLM's: `out.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax / sigmoid of the logits, as vLLM applies them (logits with use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per input, shaped as vLLM's: `out.outputs.probs`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair, shaped as vLLM's: `out.outputs.score`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True

"""PoolingEngine: embeddings of an encoder or converted decoder model (the pooling runner). Inputs are tokenized and
validated here, sorted by length and batched by tokens; no scheduler or KV cache, as one forward finishes every
sequence."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from strata.config import EngineConfig
from strata.engine.scoring import ScoringMixin
from strata.errors import RequestError
from strata.executor.multiproc_pooling import create_pooling_runner
from strata.layers.pooler import normalize
from strata.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Most inputs in one request (vLLM sets none; OpenAI's is 2,048): a bound on what one request may hold up.
MAX_INPUTS = 2048
EmbedInput = str | list[int]


@dataclass(frozen=True)
class EmbedResult:
    embeddings: list[torch.Tensor]  # one float32 vector per input, in input order
    prompt_token_ids: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)


class PoolingEngine(ScoringMixin):
    """Serves `embed` (and `classify`, `score`) for a `--runner pooling` model; thread-safe (one batch runs at a
    time). With tensor_parallel_size > 1 the runner's ranks are worker processes (shut them down with `shutdown`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.tokenizer_gguf_file)
        self.runner = create_pooling_runner(config)
        self.max_model_len = min(config.model.max_model_len, self.runner.max_positions)
        self.vocab_size = config.model.vocab_size
        self._lock = threading.Lock()

    @property
    def pooling(self):  # noqa: ANN201 - PoolingConfig
        return self.runner.pooling

    @property
    def hidden_size(self) -> int:
        return self.runner.hidden_size

    def embed(self, inputs: Sequence[EmbedInput], truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> EmbedResult:
        """Embeddings of texts or token-id lists; bad inputs are RequestErrors naming the field."""
        if self.runner.num_labels is not None:
            raise RequestError("this model is a sequence classifier (cross-encoder): it serves /classify, /score and "
                               "/rerank (LLM.classify, LLM.score), not embeddings; serve an embedding model (e.g. "
                               "BertModel) for /v1/embeddings", param="model")
        self.pooling.check_dimensions(dimensions, self.hidden_size)
        sequences = self.tokenize(inputs, truncate_prompt_tokens)
        with self._lock:
            vectors = self._run(sequences)
        if dimensions is not None and dimensions < vectors.shape[1]:
            vectors = vectors[:, :dimensions]
            if self.pooling.normalize:  # Matryoshka: truncate, then renormalize
                vectors = normalize(vectors)
        return EmbedResult(list(vectors.unbind(0)), sequences)

    def tokenize(self, inputs: Sequence[EmbedInput], truncate_prompt_tokens: int | None) -> list[list[int]]:
        if not inputs:
            raise RequestError("`input` is empty; give a string, a list of strings or of token-id lists",
                               param="input")
        if len(inputs) > MAX_INPUTS:
            raise RequestError(f"`input` has {len(inputs)} items; at most {MAX_INPUTS} per request", param="input")
        limit = self._truncation(truncate_prompt_tokens)
        return [self._tokenize_one(item, i, limit) for i, item in enumerate(inputs)]

    def _truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.max_model_len
        if not 1 <= truncate_prompt_tokens <= self.max_model_len:
            raise RequestError(f"`truncate_prompt_tokens` must be -1 (the model's maximum) or between 1 and "
                               f"{self.max_model_len}, got {truncate_prompt_tokens}", param="truncate_prompt_tokens")
        return truncate_prompt_tokens

    def _tokenize_one(self, item: EmbedInput, index: int, limit: int | None) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise RequestError(f"input[{index}] is an empty string", param="input")
            # Truncation keeps the start and the closing special tokens, as sentence-transformers' encode does.
            ids = self.tokenizer(item, truncation=limit is not None, max_length=limit).input_ids
        else:
            if not item:
                raise RequestError(f"input[{index}] is an empty list of token ids", param="input")
            bad = [t for t in item if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"input[{index}] has token ids {bad[:5]} outside the vocabulary "
                                   f"[0, {self.vocab_size})", param="input")
            ids = list(item[:limit]) if limit is not None else list(item)
        if len(ids) > self.max_model_len:
            raise RequestError(f"input[{index}] has {len(ids)} tokens, more than the model's maximum of "
                               f"{self.max_model_len}; shorten it or set `truncate_prompt_tokens`",
                               param="input")
        return ids

    def _run(self, sequences: list[list[int]], forward: Callable[[list[int]], torch.Tensor] | None = None,
             width: int | None = None) -> torch.Tensor:
        """Longest first, batches of at most max_num_batched_tokens tokens (padded attention wastes least when
        the lengths in a batch are close) and max_num_seqs sequences; results back in input order. `forward` maps
        a batch's indices to its [len, width] outputs (default: the embeddings)."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        budget = max(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        max_seqs = self.config.scheduler.max_num_seqs
        forward = forward or (lambda indices: self.runner.embed([sequences[j] for j in indices]))
        out = torch.empty(len(sequences), width or self.hidden_size)
        batch: list[int] = []
        tokens = 0
        for i in [*order, None]:
            if batch and (i is None or tokens + len(sequences[i]) > budget or len(batch) == max_seqs):
                out[batch] = forward(batch)
                batch, tokens = [], 0
            if i is not None:
                batch.append(i)
                tokens += len(sequences[i])
        return out

    def check_health(self) -> None:
        """EngineDeadError once a TP worker process died."""
        self.runner.check_health()

    def shutdown(self) -> None:
        self.runner.shutdown()

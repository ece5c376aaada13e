"""Classification and scoring of the pooling engine (LLM.classify / LLM.score, /classify, /score, /rerank): text
pairs 1:1, 1:N or N:N as vLLM pairs them; a cross-encoder scores each pair encoded with the tokenizer's text-pair
template, an embedding model the cosine similarity of the two embeddings."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from strata.config.pooling_config import classify_activation, score_activation
from strata.errors import RequestError
from strata.layers.pooler import activate

# Most pairs in one score or rerank request: every pair is a full forward pass of the model, so a request of
# thousands of documents would hold the server for long; larger sets are split by the client.
MAX_SCORE_PAIRS = 512


def pair_texts(text_1: str | list[str], text_2: str | list[str],
               names: tuple[str, str] = ("text_1", "text_2")) -> tuple[list[str], list[str]]:
    """The two sides as lists (not yet broadcast); bad shapes and empty texts are RequestErrors naming the field."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in zip(names, (firsts, seconds), strict=True):
        if not texts:
            raise RequestError(f"`{name}` is an empty list; give at least one text", param=name)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise RequestError(f"`{names[0]}` has {len(firsts)} texts and `{names[1]}` {len(seconds)}: give one "
                           f"{names[0]} for all, or two lists of the same length (pairs 1:1, 1:N or N:N)",
                           param=names[1])
    if len(seconds) > MAX_SCORE_PAIRS:
        raise RequestError(f"`{names[1]}` has {len(seconds)} items; at most {MAX_SCORE_PAIRS} per request: split "
                           "them over several requests", param=names[1])
    for name, value, texts in zip(names, (text_1, text_2), (firsts, seconds), strict=True):
        for i, text in enumerate(texts):
            if not text:
                where = name if isinstance(value, str) else f"{name}[{i}]"
                raise RequestError(f"{where} is an empty string", param=name)
    return firsts, seconds


def tokenize_texts(tokenizer: Any, texts: list[str], name: str, limit: int | None,
                   max_len: int) -> list[list[int]]:
    """Each text alone (an embedding model's side of a pair)."""
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, truncation=limit is not None, max_length=limit).input_ids
        _check_length(len(ids), f"{name}[{i}]", name, max_len)
        out.append(ids)
    return out


def tokenize_pairs(tokenizer: Any, firsts: list[str], seconds: list[str], names: tuple[str, str],
                   limit: int | None, max_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and segment ids of each (first, second) pair, as sentence-transformers' CrossEncoder encodes them;
    truncation (when asked for) cuts the longer text first, as its `truncation=True` does."""
    # Segment ids only where the model takes them (BERT); RoBERTa's tokenizers leave them out, and the model
    # then sees zeros, as transformers' does.
    segments = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
    ids, types = [], []
    for i, (first, second) in enumerate(zip(firsts, seconds, strict=True)):
        enc = tokenizer(first, second, truncation="longest_first" if limit is not None else False, max_length=limit,
                        return_token_type_ids=segments)
        _check_length(len(enc.input_ids), f"the pair {names[1]}[{i}]", names[1], max_len)
        ids.append(list(enc.input_ids))
        types.append(list(enc.token_type_ids) if segments else [0] * len(enc.input_ids))
    return ids, types


def _check_length(n: int, what: str, param: str, max_len: int) -> None:
    if n > max_len:
        raise RequestError(f"{what} has {n} tokens, more than the model's maximum of {max_len}; shorten it or set "
                           "`truncate_prompt_tokens`", param=param)


@dataclass(frozen=True)
class ClassifyResult:
    probs: list[torch.Tensor]  # per input: probabilities (or logits without the activation), float32
    prompt_token_ids: list[list[int]]
    labels: list[str | None]  # per input: the name of its most likely class, from the checkpoint's id2label

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)


@dataclass(frozen=True)
class ScoreResult:
    scores: list[float]  # per pair, in the order of the second list
    prompt_token_ids: list[list[int]]  # per pair: both sides' tokens

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)


class ScoringMixin:
    """`classify` and `score` of PoolingEngine (which provides the runner, tokenizer, batching and lock)."""

    def classify(self, inputs: Sequence[str | list[int]], truncate_prompt_tokens: int | None = None,
                 use_activation: bool = True) -> ClassifyResult:
        """Class probabilities per input (softmax or sigmoid as vLLM applies them; raw logits without)."""
        num_labels = self._require_classifier("/classify (LLM.classify)")
        sequences = self.tokenize(inputs, truncate_prompt_tokens)
        with self._lock:
            logits = self._run(sequences, lambda batch: self.runner.classify([sequences[j] for j in batch]),
                               num_labels)
        probs = activate(logits, classify_activation(self.config.model.hf_config, num_labels)) if use_activation \
            else logits
        id2label = self.config.model.hf_config.get("id2label") or {}
        labels = [id2label.get(str(int(row.argmax()))) for row in logits]
        return ClassifyResult(list(probs.unbind(0)), sequences, labels)

    def score(self, text_1: str | list[str], text_2: str | list[str], truncate_prompt_tokens: int | None = None,
              use_activation: bool = True, names: tuple[str, str] = ("text_1", "text_2")) -> ScoreResult:
        """One score per pair: a cross-encoder's relevance, or an embedding model's cosine similarity."""
        firsts, seconds = pair_texts(text_1, text_2, names)
        limit = self._truncation(truncate_prompt_tokens)
        if self.runner.num_labels is None:
            return self._cosine_scores(firsts, seconds, names, limit)
        if self.runner.num_labels != 1:
            raise RequestError(f"this classifier has {self.runner.num_labels} labels; scoring and reranking need a "
                               "cross-encoder with one output (num_labels=1): use /classify (LLM.classify) for "
                               "its class probabilities", param="model")
        firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
        ids, types = tokenize_pairs(self.tokenizer, firsts, seconds, names, limit, self.max_model_len)
        with self._lock:
            logits = self._run(ids, lambda batch: self.runner.classify([ids[j] for j in batch],
                                                                       [types[j] for j in batch]), 1)
        if use_activation:
            logits = activate(logits, score_activation(self.config.model.hf_config, 1))
        return ScoreResult(logits[:, 0].tolist(), ids)

    def _cosine_scores(self, firsts: list[str], seconds: list[str], names: tuple[str, str],
                       limit: int | None) -> ScoreResult:
        """vLLM's score for an embedding model: each side embedded alone, then their cosine similarity."""
        ids_1 = tokenize_texts(self.tokenizer, firsts, names[0], limit, self.max_model_len)
        ids_2 = tokenize_texts(self.tokenizer, seconds, names[1], limit, self.max_model_len)
        sequences = ids_1 + ids_2
        with self._lock:
            vectors = self._run(sequences)
        left, right = vectors[:len(ids_1)], vectors[len(ids_1):]
        left = left.expand(len(ids_2), -1) if len(ids_1) == 1 else left
        pairs = [ids_1[0 if len(ids_1) == 1 else i] + ids for i, ids in enumerate(ids_2)]
        return ScoreResult(F.cosine_similarity(left, right, dim=-1).tolist(), pairs)

    def _require_classifier(self, what: str) -> int:
        if self.runner.num_labels is None:
            raise RequestError(f"{what} needs a sequence classifier (e.g. BertForSequenceClassification); this is an "
                               "embedding model: use /v1/embeddings (LLM.embed) or /score (LLM.score)",
                               param="model")
        return self.runner.num_labels

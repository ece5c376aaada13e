"""Qwen3-Reranker served as vLLM serves it (`hf_overrides` naming Qwen3ForSequenceClassification, its answer tokens
and `is_original_qwen3_reranker`): LLM.score / LLM.classify against the model card's transformers recipe (log_softmax
over the [no, yes] logits at the last token) on a random Qwen3 checkpoint, and the refusals around it."""
from __future__ import annotations

import pytest
import torch
from qwen3_reranker_checkpoints import (
    DOCS,
    NO,
    OVERRIDES,
    QUERY,
    YES,
    card_scores,
    vllm_pair_tokens,
    write_qwen3_reranker,
)

from strata import LLM
from strata.errors import ConfigError, UnsupportedModelError


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_qwen3_reranker(tmp_path_factory.mktemp("qwen3_reranker") / "qwen3")


def test_score_and_rerank_order_match_the_model_card_recipe(qwen3):
    with LLM(str(qwen3), hf_overrides=OVERRIDES, max_num_batched_tokens=128, max_num_seqs=2) as llm:
        outs = llm.score(QUERY, DOCS)
        classified = llm.classify([QUERY + DOCS[0]])
    sequences = [vllm_pair_tokens(qwen3, QUERY, d) for d in DOCS]
    assert [o.prompt_token_ids for o in outs] == sequences
    got = torch.tensor([o.outputs.score for o in outs])
    expected = card_scores(qwen3, sequences)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert got.std() > 1e-3  # the scores tell the documents apart
    assert len(classified[0].outputs.probs) == 1 and 0 < classified[0].outputs.probs[0] < 1


def test_reranker_refuses_generation_and_embeddings(qwen3):
    from strata.errors import RequestError

    with pytest.raises(ConfigError, match="cannot generate text"):
        LLM(str(qwen3), hf_overrides=OVERRIDES, runner="generate")
    with LLM(str(qwen3), hf_overrides=OVERRIDES) as llm, pytest.raises(RequestError, match="classifier"):
        llm.embed("hello")


@pytest.mark.parametrize(("overrides", "error", "words"), [
    ({"architectures": ["Qwen3ForSequenceClassification"]}, UnsupportedModelError, "is_original_qwen3_reranker"),
    ({"is_original_qwen3_reranker": True, "classifier_from_token": [NO, YES]}, ConfigError,
     "Qwen3ForSequenceClassification"),
    ({**OVERRIDES, "classifier_from_token": [YES]}, ConfigError, "two tokens"),
    ({**OVERRIDES, "classifier_from_token": ["no", "yes"]}, ConfigError, "not a token"),
])
def test_incomplete_reranker_overrides_are_refused_naming_the_fix(qwen3, overrides, error, words):
    with pytest.raises(error, match=words):
        LLM(str(qwen3), hf_overrides=overrides, runner="pooling")

"""Decoders served as sequence classifiers (vLLM's --convert classify): Qwen3ForSequenceClassification and
LlamaForSequenceClassification checkpoints written by transformers give AutoModelForSequenceClassification's
logits (its `score` head at the last token), through LLM.classify and LLM.score."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checkpoints import edit_config
from decoder_classifier_checkpoints import transformers_logits, write_classifier

from strata import LLM
from strata.errors import ConfigError, RequestError, UnsupportedModelError

TEXTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n", "import os",
         "Paged attention stores keys and values in fixed size blocks. " * 3, "a"]
# Several packed batches of mixed lengths.
SMALL_BATCHES = {"max_num_batched_tokens": 64, "max_num_seqs": 2}


@pytest.fixture(scope="module")
def qwen3_classifier(tmp_path_factory) -> Path:
    return write_classifier(tmp_path_factory.mktemp("qwen3cls"), "qwen3", num_labels=3, seed=1)


def test_qwen3_sequence_classifier_gives_transformers_logits_and_softmax(qwen3_classifier):
    with LLM(str(qwen3_classifier), **SMALL_BATCHES) as llm:  # *ForSequenceClassification: classify by default
        logits = llm.classify(TEXTS, use_activation=False)
        probs = llm.classify(TEXTS)
        with pytest.raises(RequestError, match="classifier"):
            llm.embed(TEXTS[0])
    expected = transformers_logits(qwen3_classifier, [o.prompt_token_ids for o in logits])
    got = torch.tensor([o.outputs.probs for o in logits])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in probs]), expected.softmax(-1), atol=1e-5,
                               rtol=1e-4)


def test_convert_classify_on_a_causal_lm_named_llama_reads_its_score_head_and_scores(tmp_path):
    folder = write_classifier(tmp_path / "llama", "llama", num_labels=1, seed=2)
    edit_config(folder, architectures=["LlamaForCausalLM"])  # a head vLLM finds only when told: --convert classify
    with pytest.raises(UnsupportedModelError, match="score.weight.*--convert classify"):  # else: an embedder's
        LLM(str(folder), runner="pooling")
    with LLM(str(folder), convert="classify") as llm:
        logits = llm.classify(TEXTS, use_activation=False)
        probs = llm.classify(TEXTS[:2])
    expected = transformers_logits(folder, [o.prompt_token_ids for o in logits])
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in logits]), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in probs]), expected[:2].sigmoid(), atol=1e-5,
                               rtol=1e-4)


def test_convert_classify_is_refused_for_generation_and_headless_encoders(qwen3_classifier, tmp_path):
    from bert_checkpoints import write_bert_checkpoint

    with pytest.raises(ConfigError, match="cannot also generate"):
        LLM(str(qwen3_classifier), convert="classify", runner="generate")
    with pytest.raises(ConfigError, match="no classification head"):
        LLM(str(write_bert_checkpoint(tmp_path / "bert")), convert="classify")

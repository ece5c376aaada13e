"""A decoder judged by its next token (Qwen3-Reranker's scoring, as vLLM does it): sigmoid(logit_yes - logit_no) at
the last position of each prompt, against the model card's transformers recipe (softmax over [no, yes] of the last
logits, left-padded batch) on a random Qwen3 checkpoint, for prompts of mixed lengths."""
from __future__ import annotations

import pytest
import torch
from arch_checkpoints import make_arch

from strata.config import EngineConfig
from strata.errors import ConfigError
from strata.executor.decoder_scoring import DecoderScorer, yes_no_token_ids

# The model card's prompt: a system turn fixing the answer to yes / no, the pair, an empty thinking block.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PAIRS = [("quick brown fox", "The quick brown fox jumps over the lazy dog."),
         ("what is paged attention?", "Paged attention stores keys and values in fixed size blocks. " * 2),
         ("import", "import os")]
# The tiny BPE has no "yes" / "no": two of its single tokens answer instead.
YES, NO = "Ġquick", "import"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_arch(tmp_path_factory.mktemp("reranker") / "qwen3", "qwen3")


def _card_inputs(tokenizer) -> list[list[int]]:
    """The card's `process_inputs`: prefix tokens + the formatted pair's + suffix tokens."""
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)
    body = [f"<Instruct>: {INSTRUCTION}\n<Query>: {q}\n<Document>: {d}" for q, d in PAIRS]
    return [prefix + ids + suffix for ids in tokenizer(body, add_special_tokens=False).input_ids]


def _card_scores(folder, sequences: list[list[int]], yes: int, no: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer.pad({"input_ids": sequences}, padding=True, return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        last = model(**batch).logits[:, -1, :]
    return torch.log_softmax(torch.stack([last[:, no], last[:, yes]], dim=1), dim=1)[:, 1].exp()


def test_yes_no_scores_match_the_model_card_recipe(qwen3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3)
    yes, no = yes_no_token_ids(tokenizer, YES, NO)
    sequences = _card_inputs(tokenizer)
    assert len({len(s) for s in sequences}) == len(sequences)  # mixed lengths: left padding in the oracle
    got = DecoderScorer(EngineConfig.create(str(qwen3)), yes, no).score(sequences)
    expected = _card_scores(qwen3, sequences, yes, no)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert got.std() > 1e-3  # the scores tell the pairs apart


def test_answer_tokens_outside_the_vocabulary_are_refused(qwen3):
    from transformers import AutoTokenizer

    with pytest.raises(ConfigError, match="'yes'"):
        yes_no_token_ids(AutoTokenizer.from_pretrained(qwen3))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        DecoderScorer(EngineConfig.create(str(qwen3)), 10**6, 1)

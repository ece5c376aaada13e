"""Decoders served as embedding models (the pooling runner): a Qwen3-Embedding-like checkpoint against
sentence-transformers and the model card's transformers recipe, `--convert embed` on a plain Llama checkpoint, and the
refusals between generation and embedding."""
from __future__ import annotations

import pytest
import torch
from decoder_embedding_checkpoints import (
    TEXTS,
    model_card_embeddings,
    sentence_transformers_embeddings,
    write_qwen3_embedding,
)

from strata import LLM
from strata.errors import ConfigError, RequestError


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    return write_qwen3_embedding(tmp_path_factory.mktemp("qwen3_embedding") / "model")


def _assert_same_direction(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    cos = torch.nn.functional.cosine_similarity(got, expected.float())
    assert (1 - cos).abs().max() < 1e-5, cos


def _embed(llm: LLM, inputs, **kwargs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(inputs, **kwargs)])


def test_qwen3_embedding_matches_sentence_transformers_and_the_model_card(qwen3_embedding):
    # Small batches (by tokens and by sequences): the mixed lengths run in several packed forwards.
    with LLM(str(qwen3_embedding), runner="pooling", max_num_batched_tokens=64, max_num_seqs=2) as llm:
        got = _embed(llm, TEXTS)
        ids = llm.get_tokenizer()(TEXTS[1]).input_ids
        by_ids = _embed(llm, [ids])
    assert ids[-1] == 1  # the tokenizer closes the text with </s>: the token pooled
    _assert_same_direction(got, sentence_transformers_embeddings(qwen3_embedding, TEXTS))
    _assert_same_direction(got, model_card_embeddings(qwen3_embedding, TEXTS))
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(TEXTS)))
    torch.testing.assert_close(by_ids[0], got[1])


def test_dimensions_cut_and_renormalize_the_embedding(qwen3_embedding):
    with LLM(str(qwen3_embedding), runner="pooling") as llm:
        cut = _embed(llm, TEXTS[:2], dimensions=16)
        with pytest.raises(RequestError, match="dimensions"):
            llm.embed(TEXTS[0], dimensions=65)
    expected = torch.nn.functional.normalize(model_card_embeddings(qwen3_embedding, TEXTS[:2])[:, :16], dim=-1)
    _assert_same_direction(cut, expected)


def test_convert_embed_on_a_llama_checkpoint_is_the_model_card_recipe(llama_gqa):
    texts = ["The quick brown fox", "import os\nimport sys\n", "a", "Once upon a time there was a small model"]
    with LLM(str(llama_gqa), convert="embed") as llm:
        got = _embed(llm, texts)
        with pytest.raises(RequestError, match="LLM.embed"):
            llm.generate("hello")
    _assert_same_direction(got, model_card_embeddings(llama_gqa, texts))


def test_embed_on_a_generation_model_and_convert_with_runner_generate_are_refused(llama_gqa):
    with pytest.raises(ConfigError, match="--runner generate"):
        LLM(str(llama_gqa), convert="embed", runner="generate")
    with LLM(str(llama_gqa), max_model_len=64) as llm:
        with pytest.raises(RequestError, match="runner='pooling'"):
            llm.embed("hello")


def test_hf_overrides_make_a_checkpoint_matryoshka_for_dimensions(tmp_path):
    folder = write_qwen3_embedding(tmp_path / "plain", matryoshka=False)
    with LLM(str(folder), runner="pooling") as llm, pytest.raises(RequestError, match="dimensions"):
        llm.embed(TEXTS[0], dimensions=16)
    with LLM(str(folder), runner="pooling", hf_overrides={"matryoshka_dimensions": [16, 32]}) as llm:
        cut = _embed(llm, TEXTS[:2], dimensions=16)
        with pytest.raises(RequestError, match=r"\[16, 32\]"):
            llm.embed(TEXTS[0], dimensions=20)
    expected = torch.nn.functional.normalize(model_card_embeddings(folder, TEXTS[:2])[:, :16], dim=-1)
    _assert_same_direction(cut, expected)

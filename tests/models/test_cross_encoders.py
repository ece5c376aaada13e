"""BertForSequenceClassification and XLMRobertaForSequenceClassification (LLM.score, LLM.classify) against
sentence-transformers' CrossEncoder and transformers, and XLMRobertaModel embeddings against SentenceTransformer, on
random-weight checkpoints (float32, mixed lengths, several batches)."""
from __future__ import annotations

import pytest
import torch
from bert_checkpoints import write_bert_checkpoint, write_cross_encoder_checkpoint, write_xlm_roberta_checkpoint

from strata import LLM
from strata.errors import RequestError

QUERY = "what stores keys and values"
DOCS = ["Paged attention stores keys and values in fixed size blocks.", "def add(a, b):",
        "Once upon a time there was a small model that served tokens very quickly. " * 2, "import os",
        "The quick brown fox jumps over the lazy dog."]
# Several batches of different lengths: 64 tokens, 2 sequences at most per batch.
SMALL_BATCHES = {"max_num_batched_tokens": 64, "max_num_seqs": 2}


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def reranker(request, tmp_path_factory):
    return write_cross_encoder_checkpoint(tmp_path_factory.mktemp("ce") / request.param, family=request.param,
                                          seed=3)


def test_scores_and_rerank_order_equal_sentence_transformers_cross_encoder(reranker):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(reranker), device="cpu")
    expected = torch.tensor(ce.predict([(QUERY, d) for d in DOCS], batch_size=2))
    expected_order = [r["corpus_id"] for r in ce.rank(QUERY, DOCS)]
    with LLM(str(reranker), **SMALL_BATCHES) as llm:
        one_to_n = llm.score(QUERY, DOCS)
        n_to_n = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]])
    got = torch.tensor([o.outputs.score for o in one_to_n])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == expected_order
    pairs = torch.tensor(ce.predict([(QUERY, DOCS[1]), (DOCS[0], DOCS[2])]))
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in n_to_n]), pairs, atol=1e-5, rtol=0)
    # The prompt is the pair as the tokenizer's text-pair template encodes it.
    assert one_to_n[0].prompt_token_ids == ce.tokenizer(QUERY, DOCS[0]).input_ids


def test_classify_probabilities_are_softmax_of_transformers_logits(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = write_cross_encoder_checkpoint(tmp_path / "cls3", family="xlm-roberta", num_labels=3, seed=5,
                                            id2label={0: "neg", 1: "neutral", 2: "pos"},
                                            label2id={"neg": 0, "neutral": 1, "pos": 2})
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = torch.cat([model(**tokenizer(d, return_tensors="pt")).logits for d in DOCS])
    with LLM(str(folder), **SMALL_BATCHES) as llm:
        probs = llm.classify(DOCS)
        raw = llm.classify(DOCS[:1], use_activation=False)
        with pytest.raises(RequestError, match="/classify"):  # three labels: no single relevance score
            llm.score(QUERY, DOCS)
        with pytest.raises(RequestError, match="/v1/embeddings"):
            llm.embed(DOCS)
    got = torch.tensor([o.outputs.probs for o in probs])
    torch.testing.assert_close(got, torch.softmax(logits, -1), atol=1e-5, rtol=0)
    assert probs[0].outputs.num_classes == 3
    torch.testing.assert_close(torch.tensor(raw[0].outputs.probs), logits[0], atol=1e-5, rtol=0)


def test_xlm_roberta_embeddings_match_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = write_xlm_roberta_checkpoint(tmp_path / "xlmr", pooling="mean")
    expected = SentenceTransformer(str(folder), device="cpu").encode(DOCS, convert_to_tensor=True, batch_size=2)
    with LLM(str(folder), **SMALL_BATCHES) as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(DOCS)])
        # An embedding model scores a pair by the cosine similarity of the two embeddings, as vLLM does.
        scores = [o.outputs.score for o in llm.score(DOCS[0], DOCS[1:3])]
    cos = torch.nn.functional.cosine_similarity(got, expected)
    assert (1 - cos).abs().max() < 1e-5, cos
    torch.testing.assert_close(torch.tensor(scores), torch.nn.functional.cosine_similarity(
        expected[:1], expected[1:3]), atol=1e-5, rtol=0)


def test_score_refuses_mismatched_lists_and_long_pairs_unless_truncated_as_cross_encoder_does(tmp_path):
    from sentence_transformers import CrossEncoder

    folder = write_cross_encoder_checkpoint(tmp_path / "bert", family="bert", max_positions=32)
    expected = float(CrossEncoder(str(folder), device="cpu", max_length=32).predict([(QUERY, DOCS[2])])[0])
    with LLM(str(folder)) as llm:
        with pytest.raises(RequestError, match="1:1, 1:N or N:N"):
            llm.score(DOCS[:2], DOCS[:3])
        with pytest.raises(RequestError, match="truncate_prompt_tokens"):
            llm.score(QUERY, DOCS[2])
        out = llm.score(QUERY, DOCS[2], truncate_prompt_tokens=-1)[0]
        with pytest.raises(RequestError, match="not embeddings"):
            llm.embed(QUERY)
    assert len(out.prompt_token_ids) == 32
    assert abs(out.outputs.score - expected) < 1e-5


def test_classify_on_an_embedding_model_names_the_embedding_routes(tmp_path):
    folder = write_bert_checkpoint(tmp_path / "emb", pooling="cls", normalize=False)
    with LLM(str(folder)) as llm, pytest.raises(RequestError, match="sequence classifier"):
        llm.classify(QUERY)

"""/classify, /score, /v1/score, /rerank, /v1/rerank and /v2/rerank of a `strata serve` cross-encoder against
sentence-transformers' CrossEncoder; bad inputs are clear 400s and the server stays up."""
from __future__ import annotations

import httpx
import pytest
import torch
from bert_checkpoints import write_cross_encoder_checkpoint
from conftest import start_server, stop_server

QUERY = "what stores keys and values"
DOCS = ["Paged attention stores keys and values in fixed size blocks.", "def add(a, b):",
        "Once upon a time there was a small model that served tokens very quickly.", "import os"]


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory):
    return write_cross_encoder_checkpoint(tmp_path_factory.mktemp("rerank") / "ce", family="bert", seed=4)


@pytest.fixture(scope="module")
def rerank_server(reranker_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("rerank_log") / "server.log"
    srv = start_server(reranker_folder, log, "--served-model-name", "reranker")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def expected(reranker_folder):
    from sentence_transformers import CrossEncoder

    return torch.tensor(CrossEncoder(str(reranker_folder), device="cpu").predict([(QUERY, d) for d in DOCS]))


@pytest.fixture
def client(rerank_server):
    with httpx.Client(base_url=rerank_server.url, timeout=60) as http:
        yield http


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_documents_by_cross_encoder_relevance(client, expected, path):
    body = client.post(path, json={"model": "reranker", "query": QUERY, "documents": DOCS}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert [r["index"] for r in body["results"]] == order
    got = torch.tensor([r["relevance_score"] for r in body["results"]])
    torch.testing.assert_close(got, expected[order], atol=1e-5, rtol=0)
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
    assert body["model"] == "reranker" and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
    top = client.post(path, json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                  "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all(r["document"] is None for r in top["results"])


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_one_to_n_and_n_to_n_equal_cross_encoder(client, expected, path):
    body = client.post(path, json={"text_1": QUERY, "text_2": DOCS}).json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["score"] * len(DOCS)
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), expected, atol=1e-5, rtol=0)
    pairs = client.post(path, json={"text_1": [QUERY, QUERY], "text_2": DOCS[2:]}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in pairs["data"]]), expected[2:], atol=1e-5, rtol=0)


def test_classify_gives_sigmoid_probabilities_of_the_single_label(client, reranker_folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reranker_folder).eval()
    with torch.no_grad():
        logit = model(**AutoTokenizer.from_pretrained(reranker_folder)(DOCS[0], return_tensors="pt")).logits[0]
    body = client.post("/classify", json={"input": [DOCS[0]]}).json()
    data = body["data"][0]
    assert data["num_classes"] == 1 and data["label"] == "LABEL_0" and body["usage"]["prompt_tokens"] > 0
    torch.testing.assert_close(torch.tensor(data["probs"]), torch.sigmoid(logit), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "empty list"),
    ("/v1/rerank", {"query": QUERY, "documents": ["doc"] * 1000}, "documents", "at most 512"),
    ("/v2/rerank", {"query": "", "documents": DOCS}, "query", "empty string"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", "top_n"),
    ("/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}, "text_2", "1:1, 1:N or N:N"),
    ("/score", {"text_1": QUERY, "text_2": ["ok", ""]}, "text_2", "text_2[1]"),
    ("/score", {"text_1": QUERY, "text_2": "word " * 100}, "text_2", "truncate_prompt_tokens"),
    ("/classify", {"input": []}, "input", "empty"),
    ("/v1/embeddings", {"input": "hello"}, "model", "/classify, /score and /rerank"),
    ("/v1/chat/completions", {"messages": []}, "model", "cannot generate text"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "other"}, "model", "does not exist"),
])
def test_bad_requests_are_clear_errors_and_the_server_stays_up(client, path, body, param, words):
    r = client.post(path, json=body)
    assert r.status_code == (404 if words == "does not exist" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert client.post("/rerank", json={"query": QUERY, "documents": DOCS[:1]}).status_code == 200


@pytest.mark.parametrize("path", ["/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"])
def test_scoring_on_a_generation_server_names_runner_pooling(http, path):
    r = http.post(path, json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]

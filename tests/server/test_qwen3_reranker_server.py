"""`strata serve` of Qwen3-Reranker with vLLM's --hf-overrides: /rerank and /score against the model card's
transformers recipe (order and scores), the templates given by the client as vLLM's example gives them."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import start_server, stop_server
from qwen3_reranker_checkpoints import DOCS, OVERRIDES, QUERY, card_scores, vllm_pair_tokens, write_qwen3_reranker


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_qwen3_reranker(tmp_path_factory.mktemp("qwen3_reranker_server") / "qwen3")


@pytest.fixture(scope="module")
def client(reranker, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen3_reranker_log") / "server.log"
    srv = start_server(reranker, log, "--hf-overrides", json.dumps(OVERRIDES), "--served-model-name", "rr")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            yield http
    finally:
        stop_server(srv)


def test_rerank_and_score_follow_the_model_card_recipe(client, reranker):
    expected = card_scores(reranker, [vllm_pair_tokens(reranker, QUERY, d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    body = client.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3}).json()
    assert [r["index"] for r in body["results"]] == order[:3]
    torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in body["results"]]), expected[order[:3]],
                               atol=1e-5, rtol=0)
    scores = client.post("/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in scores["data"]]), expected, atol=1e-5, rtol=0)
    r = client.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and "/rerank" in r.json()["error"]["message"]

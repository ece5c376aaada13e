"""`strata serve --runner pooling` of a Qwen3-Embedding-like decoder: the openai client's embeddings.create (float,
base64, `dimensions`) against sentence-transformers; generation routes answer 400 naming /v1/embeddings."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from conftest import start_server, stop_server
from decoder_embedding_checkpoints import TEXTS, sentence_transformers_embeddings, write_qwen3_embedding


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return write_qwen3_embedding(tmp_path_factory.mktemp("qwen3_embed") / "model")


@pytest.fixture(scope="module")
def qwen3_server(qwen3_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen3_embed_log") / "server.log"
    srv = start_server(qwen3_folder, log, "--served-model-name", "qwen3-emb", "--runner", "pooling")
    yield srv
    stop_server(srv)


def _assert_close(got, expected: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(torch.as_tensor(np.asarray(got), dtype=torch.float32), expected)
    assert (1 - cos).abs().max() < 1e-5, cos


def test_openai_client_embeddings_of_a_decoder_match_sentence_transformers(qwen3_server, qwen3_folder):
    import openai

    expected = sentence_transformers_embeddings(qwen3_folder, TEXTS)
    client = openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="none", max_retries=0)
    floats = client.embeddings.create(model="qwen3-emb", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="qwen3-emb", input=TEXTS)  # base64, decoded by the client
    _assert_close([d.embedding for d in floats.data], expected)
    _assert_close([d.embedding for d in packed.data], expected)
    cut = client.embeddings.create(model="qwen3-emb", input=TEXTS[:2], dimensions=16, encoding_format="float")
    assert [len(d.embedding) for d in cut.data] == [16, 16]
    _assert_close([d.embedding for d in cut.data], torch.nn.functional.normalize(expected[:2, :16], dim=-1))


def test_generation_on_a_decoder_embedding_server_names_the_endpoint(qwen3_server):
    with httpx.Client(base_url=qwen3_server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
        assert http.post("/v1/embeddings", json={"input": "still up"}).status_code == 200

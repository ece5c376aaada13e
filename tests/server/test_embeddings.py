"""/v1/embeddings and /pooling of a `strata serve --runner pooling` BERT, through the openai client and raw HTTP,
against sentence-transformers; bad inputs are 400s and the server stays up."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from bert_checkpoints import write_bert_checkpoint
from conftest import start_server, stop_server

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):", "import os",
         "Paged attention stores keys and values in fixed size blocks. " * 2]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return write_bert_checkpoint(tmp_path_factory.mktemp("embed") / "bert", pooling="mean", normalize=True)


@pytest.fixture(scope="module")
def embed_server(bert_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("embed_log") / "server.log"
    srv = start_server(bert_folder, log, "--served-model-name", "bert", "--runner", "pooling")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def expected(bert_folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bert_folder), device="cpu").encode(TEXTS, convert_to_tensor=True)


def _close(got, expected) -> None:
    cos = torch.nn.functional.cosine_similarity(torch.as_tensor(np.asarray(got), dtype=torch.float32), expected)
    assert (1 - cos).abs().max() < 1e-5, cos


def test_openai_client_embeddings_float_and_base64_match_sentence_transformers(embed_server, expected):
    import openai

    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="none", max_retries=0)
    floats = client.embeddings.create(model="bert", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="bert", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    _close([d.embedding for d in floats.data], expected)
    _close([d.embedding for d in packed.data], expected)
    tokenizer_lens = floats.usage.prompt_tokens
    assert tokenizer_lens == floats.usage.total_tokens > len(TEXTS)
    single = client.embeddings.create(model="bert", input=TEXTS[1], encoding_format="float")
    _close([single.data[0].embedding], expected[1:2])


def test_token_id_inputs_and_pooling_route(embed_server, expected, bert_folder):
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(bert_folder)(t).input_ids for t in TEXTS[:2]]
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        one = http.post("/v1/embeddings", json={"input": ids[0]}).json()
        many = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()
        pooled = http.post("/pooling", json={"input": TEXTS[:2]}).json()
    assert one["usage"]["prompt_tokens"] == len(ids[0])
    _close([one["data"][0]["embedding"]], expected[:1])
    _close([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in many["data"]], expected[:2])
    _close([d["data"] for d in pooled["data"]], expected[:2])


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["ok", ""]}, "input", "input[1]"),
    ({"input": [[1, 2, 10**6]]}, "input", "outside the vocabulary"),
    ({"input": [[-1]]}, "input", "outside the vocabulary"),
    ({"input": "word " * 200}, "input", "truncate_prompt_tokens"),
    ({"input": "hello", "dimensions": 8}, "dimensions", "dimensions"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": "hello", "model": "other"}, "model", "does not exist"),
])
def test_bad_inputs_are_clear_400s_and_the_server_stays_up(embed_server, body, param, words):
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == (404 if param == "model" else 400), r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"]
        assert http.post("/v1/embeddings", json={"input": "still up"}).status_code == 200


def test_a_thousand_inputs_and_truncation_are_served(embed_server):
    with httpx.Client(base_url=embed_server.url, timeout=120) as http:
        r = http.post("/v1/embeddings", json={"input": [f"sentence number {i}" for i in range(1000)]})
        assert r.status_code == 200 and len(r.json()["data"]) == 1000
        long = http.post("/v1/embeddings", json={"input": "word " * 200, "truncate_prompt_tokens": 16}).json()
        assert long["usage"]["prompt_tokens"] == 16


def test_generation_requests_to_an_embedding_model_name_the_endpoint(embed_server):
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []})):
            r = http.post(path, json=body)
            assert r.status_code == 400 and "this model serves /v1/embeddings" in r.json()["error"]["message"]


def test_embeddings_on_a_generation_server_name_runner_pooling(http):
    r = http.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400
    assert "--runner pooling" in r.json()["error"]["message"] and "--convert embed" in r.json()["error"]["message"]

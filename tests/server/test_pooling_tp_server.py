"""`strata serve --tensor-parallel-size 2` of a decoder classifier (Qwen3ForSequenceClassification, converted to a
classifier by its name as vLLM does): /classify gives the softmax of transformers' logits and the label names."""
from __future__ import annotations

import httpx
import pytest
import torch
from conftest import start_server, stop_server
from decoder_classifier_checkpoints import LABELS, transformers_logits, write_classifier

pytestmark = pytest.mark.slow
TEXTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n", "import os"]


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    return write_classifier(tmp_path_factory.mktemp("qwen3cls") / "model", "qwen3", num_labels=3, seed=5)


@pytest.fixture(scope="module")
def tp2_server(classifier_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen3cls_log") / "server.log"
    srv = start_server(classifier_folder, log, "--served-model-name", "cls", "--tensor-parallel-size", "2")
    yield srv
    stop_server(srv)


def test_tp2_server_classifies_as_transformers(tp2_server, classifier_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(classifier_folder)
    logits = transformers_logits(classifier_folder, [tokenizer(t).input_ids for t in TEXTS])
    with httpx.Client(base_url=tp2_server.url, timeout=60) as http:
        body = http.post("/classify", json={"model": "cls", "input": TEXTS}).json()
        assert http.get("/health").status_code == 200
    assert [d["num_classes"] for d in body["data"]] == [3] * len(TEXTS)
    assert [d["label"] for d in body["data"]] == [LABELS[int(i)] for i in logits.argmax(-1)]
    torch.testing.assert_close(torch.tensor([d["probs"] for d in body["data"]]), logits.softmax(-1), atol=1e-5,
                               rtol=1e-4)

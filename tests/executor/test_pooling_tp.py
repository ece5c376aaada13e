"""The pooling runner over TP=2 worker processes (gloo on CPU) gives one process's embeddings and cross-encoder
scores; PP is refused before any process starts; a worker that dies is an EngineDeadError, not a hang."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from bert_checkpoints import write_bert_checkpoint, write_cross_encoder_checkpoint
from decoder_embedding_checkpoints import TEXTS, write_qwen3_embedding
from processes import wait_gone

from strata import LLM, ConfigError, EngineDeadError

pytestmark = pytest.mark.slow
DOCS = ["Paged attention stores keys and values in fixed size blocks.", "def add(a, b):", "import os",
        "Once upon a time there was a small model that served tokens very quickly. " * 2]
# Several packed batches of mixed lengths on each layout.
OPTIONS = {"max_num_batched_tokens": 64, "max_num_seqs": 2}


def _embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts)])


def _embeddings(folder, texts: list[str], **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(TP=1, TP=2) embeddings of the texts."""
    with LLM(str(folder), **OPTIONS, **options) as llm:
        one = _embed(llm, texts)
    with LLM(str(folder), tensor_parallel_size=2, **OPTIONS, **options) as llm:
        return one, _embed(llm, texts)


def _assert_same_direction(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    cos = torch.nn.functional.cosine_similarity(got, expected)
    assert (1 - cos).abs().max() < 1e-5, cos


def test_tp2_bert_embeddings_equal_one_process_and_a_dead_worker_is_an_error(tmp_path):
    folder = write_bert_checkpoint(tmp_path / "bert", pooling="mean", seed=4)
    with LLM(str(folder), **OPTIONS) as llm:
        expected = _embed(llm, DOCS)
    llm = LLM(str(folder), tensor_parallel_size=2, **OPTIONS)
    try:
        _assert_same_direction(_embed(llm, DOCS), expected)
        pids = llm.engine.runner.executor.worker_pids
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            for _ in range(100):  # the watchdog notices within a second; no call may hang meanwhile
                llm.embed(DOCS[:1])
        assert wait_gone(pids, 5) == []
        with pytest.raises(EngineDeadError):  # the pooling server's /health: 503
            llm.engine.check_health()
    finally:
        llm.shutdown()


def test_tp2_cross_encoder_scores_equal_one_process(tmp_path):
    folder = write_cross_encoder_checkpoint(tmp_path / "ce", family="bert", seed=3)
    query = "what stores keys and values"
    with LLM(str(folder), **OPTIONS) as llm:
        expected = [o.outputs.score for o in llm.score(query, DOCS)]
    with LLM(str(folder), tensor_parallel_size=2, **OPTIONS) as llm:
        got = [o.outputs.score for o in llm.score(query, DOCS)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)


def test_tp2_converted_qwen3_embeddings_equal_one_process(tmp_path):
    one, two = _embeddings(write_qwen3_embedding(tmp_path / "qwen3"), TEXTS, runner="pooling")
    _assert_same_direction(two, one)


def test_pipeline_parallel_pooling_is_refused_before_any_worker_starts(tmp_path):
    folder = write_bert_checkpoint(tmp_path / "bert", pooling="mean")
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2.*tensor_parallel_size instead"):
        LLM(str(folder), pipeline_parallel_size=2)

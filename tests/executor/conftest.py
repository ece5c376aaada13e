"""Checkpoints and engine settings shared by the multiprocess executor tests."""
from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints import make_llama


@pytest.fixture(scope="session")
def llama5(tmp_path_factory) -> Path:
    """5 layers (uneven PP splits), 4 heads, 2 KV heads (TP=4 replicates them), vocabulary 300 (padded to 320)."""
    return make_llama(tmp_path_factory.mktemp("llama5"), vocab_size=300, hidden_size=64, num_layers=5, num_heads=4,
                      num_kv_heads=2, intermediate_size=128, seed=5)


@pytest.fixture(scope="session")
def engine_args() -> dict:
    """Engine settings of every executor test; a small KV cache per rank, since many workers run at once.

    `strata serve` flags of node 1 in multi-node tests must give the same settings (see `cli_engine_args`).
    """
    return {"max_model_len": 128, "kv_cache_memory": 4 << 20, "max_num_seqs": 16}


@pytest.fixture(scope="session")
def cli_engine_args(engine_args) -> list[str]:
    return ["--max-model-len", str(engine_args["max_model_len"]), "--kv-cache-memory",
            str(engine_args["kv_cache_memory"]), "--max-num-seqs", str(engine_args["max_num_seqs"])]

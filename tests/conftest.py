"""Shared fixtures: tiny checkpoints built once per session in a temporary folder."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU only in Triton's interpreter, which is chosen before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints import make_llama  # noqa: E402

# One thread: tests run beside servers and worker processes on 2 cores, where more threads than
# free cores make every small op wait for a descheduled thread.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_gqa(tmp_path_factory) -> Path:
    """GQA, untied embeddings, llama3 rope scaling."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    return make_llama(tmp_path_factory.mktemp("llama_gqa"), rope_scaling=scaling, rope_theta=500000.0)


@pytest.fixture(scope="session")
def llama_tied(tmp_path_factory) -> Path:
    """Multi-head attention (no GQA), tied embeddings, plain RoPE."""
    return make_llama(tmp_path_factory.mktemp("llama_tied"), num_kv_heads=4, tied=True, num_layers=3, seed=1)


@pytest.fixture(scope="session")
def thinking_llama(tmp_path_factory) -> Path:
    """A Qwen3-style chat checkpoint whose greedy output is `<think> quick brown fox</think>` (see
    reasoning_checkpoints)."""
    from reasoning_checkpoints import make_thinking_llama

    return make_thinking_llama(tmp_path_factory.mktemp("thinking_llama"))

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


@pytest.fixture(scope="session")
def harmony_gpt_oss(tmp_path_factory) -> Path:
    """A gpt-oss checkpoint whose greedy output is harmony: analysis, then a final answer or a tool call (see
    harmony_checkpoints)."""
    from harmony_checkpoints import make_harmony_gpt_oss

    return make_harmony_gpt_oss(tmp_path_factory.mktemp("harmony_gpt_oss"))


def all_types_by_prefix() -> dict:
    """Every type strata reads, spread over one model's matrices (layer 0's fused q/k/v and gate/up pieces each in
    another type; layer 1 as Q4_K_M stores it: q/k Q4_K, v Q6_K). Imported here, not at the top: the `gguf`
    package is a test dependency the GPU machine's `pytest -m gpu` run may lack."""
    from gguf_checkpoints import BF16, F16, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

    return {"blk.0.attn_q": F16, "blk.0.attn_k": BF16, "blk.0.attn_v": Q4_0, "blk.0.attn_output": Q4_1,
            "blk.0.ffn_gate": Q5_0, "blk.0.ffn_up": Q5_1, "blk.0.ffn_down": Q8_0, "blk.1.attn_q": Q4_K,
            "blk.1.attn_k": Q4_K, "blk.1.attn_v": Q6_K, "blk.1.attn_output": Q5_K, "blk.1.ffn_gate": Q4_K,
            "blk.1.ffn_up": Q6_K, "blk.1.ffn_down": Q5_K, "token_embd": Q8_0, "output": Q6_K}


@pytest.fixture(scope="session")
def gguf_all_types(tmp_path_factory) -> Path:
    """An untied Llama (hidden 256: whole K-quant blocks) whose matrices hold every ggml type."""
    from gguf_checkpoints import types_by_prefix, write_gguf

    folder = tmp_path_factory.mktemp("gguf_all_types")
    hf = make_llama(folder / "hf", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, seed=3)
    return write_gguf(hf, folder / "all-types.gguf", types_by_prefix(all_types_by_prefix()))[0]


@pytest.fixture(scope="session")
def gguf_tied_q4_1(tmp_path_factory) -> Path:
    """A tied Llama as SmolLM2's file stores it: Q4_1 matrices, a Q8_0 embedding that is also the LM head; widths
    of whole 32-value blocks on 2 TP ranks."""
    from gguf_checkpoints import Q4_1, Q8_0, types_by_prefix, write_gguf

    folder = tmp_path_factory.mktemp("gguf_tied")
    hf = make_llama(folder / "hf", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, tied=True,
                    num_layers=3, seed=4)
    return write_gguf(hf, folder / "tied-q4_1.gguf", types_by_prefix({"token_embd": Q8_0}, Q4_1))[0]

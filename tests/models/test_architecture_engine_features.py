"""The engine's ways of running a sequence in pieces keep transformers' greedy tokens on Qwen2, Qwen3, Qwen3-MoE,
Mistral, Phi-3 and Granite: prefill chunks smaller than a block, prefix-cache hits (continuing from cached blocks),
and preemption mid-sequence (recomputed from scratch). On Qwen2's and Mistral's checkpoints the 16-token sliding
windows run over the paged cache, across chunk boundaries and cached blocks; on Qwen2's (windowed and full layers)
under the Triton kernels too (Triton's interpreter on CPU)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from arch_checkpoints import ARCHITECTURES, random_prompts, strata_greedy

from strata import LLM, SamplingParams

BLOCK_SIZE = 16
PREFIX = random_prompts((40,), seed=11)[0]  # two full blocks and a part: the cache holds the first two
SHARED_PREFIX_PROMPTS = ((*PREFIX, 7, 8, 9), (*PREFIX, 10, 11))


def block_bytes(path) -> int:
    """KV-cache bytes of one block (all layers, float32)."""
    c = json.loads((path / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * BLOCK_SIZE * 4


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_chunks_and_prefix_hits_keep_transformers_tokens(path, hf_outputs) -> None:
    # One sequence at a time, so the second finds the first's blocks cached; 6-token chunks split every block.
    outputs = strata_greedy(path, SHARED_PREFIX_PROMPTS, 8, enable_prefix_caching=True, max_num_seqs=1,
                            max_num_batched_tokens=6)
    assert tokens(outputs) == [want["tokens"] for want in hf_outputs(path, SHARED_PREFIX_PROMPTS, 8)]
    assert outputs[1].num_cached_tokens == 2 * BLOCK_SIZE


def assert_preemption_keeps_transformers_tokens(path, hf_outputs) -> None:
    prompts = tuple(tuple(p) for p in random_prompts((28, 29, 30), seed=12))
    # Six blocks admit the three prompts (two blocks each); the first to need a third block preempts another.
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory=6 * block_bytes(path),
              enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outputs) == [want["tokens"] for want in hf_outputs(path, prompts, 8)]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_chunked_prefill_and_prefix_hits_keep_transformers_tokens(arch_path, hf_outputs, name):
    assert_chunks_and_prefix_hits_keep_transformers_tokens(arch_path(name), hf_outputs)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_preemption_mid_sequence_recomputes_transformers_tokens(arch_path, hf_outputs, name):
    assert_preemption_keeps_transformers_tokens(arch_path(name), hf_outputs)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on CPU needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)")
def test_sliding_windows_under_the_triton_kernels_keep_transformers_tokens(arch_path, hf_outputs):
    """Qwen2's layers 1-2 are windowed, layer 0 is not: prompt and output run past the window, in chunks, from
    cached blocks. A handful of tokens: each step is slow in the interpreter."""
    pytest.importorskip("triton")
    path = arch_path("qwen2")
    outputs = strata_greedy(path, SHARED_PREFIX_PROMPTS, 2, kernels="triton", enable_prefix_caching=True,
                            max_num_seqs=1, max_num_batched_tokens=24)
    assert tokens(outputs) == [want["tokens"] for want in hf_outputs(path, SHARED_PREFIX_PROMPTS, 2)]
    assert outputs[1].num_cached_tokens == 2 * BLOCK_SIZE

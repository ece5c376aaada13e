"""The same code on CUDA: greedy tokens equal the CPU's (skipped without a GPU)."""
from __future__ import annotations

import pytest

from strata import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_cuda_greedy_tokens_equal_cpu(llama_gqa):
    prompts = ["def add(a, b):", "The quick brown fox", "import os"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(str(llama_gqa), device="cpu").generate(prompts, params)]
    cuda = [o.outputs[0].token_ids for o in LLM(str(llama_gqa), device="cuda", dtype="float32",
                                                 gpu_memory_utilization=0.3).generate(prompts, params)]
    assert cuda == cpu


def test_cuda_seeded_sampling_is_batch_independent(llama_gqa):
    llm = LLM(str(llama_gqa), device="cuda", gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    alone = llm.generate("hello", params)[0].outputs[0].token_ids
    batched = llm.generate(["hello", "other", "third"], params)[0].outputs[0].token_ids
    assert alone == batched


@pytest.mark.parametrize("family", ["mamba2", "plamo2", "llama4"])
def test_cuda_triton_kernels_give_the_cpu_tokens_on_every_family(family, tmp_path):
    """kernels=auto takes Triton on CUDA: Mamba2's conv/scan/update and windowed or chunked attention too."""
    from llama4_checkpoints import make_llama4_text
    from mamba_checkpoints import make_mamba2, make_plamo2

    make = {"mamba2": lambda p: make_mamba2(p, n_groups=2), "plamo2": lambda p: make_plamo2(p, window=12),
            "llama4": make_llama4_text}[family]
    path = str(make(tmp_path / family))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 9, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32").generate(prompts, params)]
    llm = LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_batched_tokens=16)
    assert llm.engine.config.kernels == "triton"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == cpu

"""A bfloat16 checkpoint with dtype=auto on a CPU without native bfloat16 arithmetic computes in float32 with its
linear weights and embedding tables kept in bfloat16: the checkpoint's memory, float32's tokens."""
from __future__ import annotations

import pytest
import torch
from checkpoints import make_llama

from strata import LLM, SamplingParams
from strata import config as config_module
from strata.config import EngineConfig
from strata.config.engine_args import EngineArgs
from strata.distributed import ParallelContext
from strata.layers.embedding import VocabParallelEmbedding
from strata.layers.linear import PackableLinear
from strata.layers.norm import RMSNorm
from strata.plan import meta_model, plan_layout


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def bf16_llama(tmp_path_factory, request):
    return make_llama(tmp_path_factory.mktemp("stored_bf16"), dtype=torch.bfloat16, tied=request.param)


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_has_native_bfloat16", lambda: False)


def test_weights_stay_bfloat16_while_the_model_computes_in_float32(bf16_llama, no_native_bf16):
    config = EngineConfig.from_args(EngineArgs(model=str(bf16_llama), device="cpu"))
    assert config.model.dtype == torch.float32 and config.model.weight_dtype == torch.bfloat16
    model = meta_model(config, ParallelContext(0, 1, 0, 1))
    for module in model.modules():
        if isinstance(module, PackableLinear | VocabParallelEmbedding):
            assert module.weight.dtype == torch.bfloat16
        if isinstance(module, RMSNorm):
            assert module.weight.dtype == torch.float32
    checkpoint_bytes = (bf16_llama / "model.safetensors").stat().st_size
    assert abs(plan_layout(config)[0].param_bytes - checkpoint_bytes) < 0.01 * checkpoint_bytes


@pytest.mark.parametrize("prompts", [1, 40])  # the small-batch kernel; widened float32 tiles for the GEMM
def test_stored_bfloat16_gives_the_float32_weights_tokens(bf16_llama, no_native_bf16, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    batch = [{"prompt_token_ids": list(range(3 + i % 7, 12 + i))} for i in range(prompts)]
    outputs = {}
    for dtype in ("auto", "float32"):
        llm = LLM(str(bf16_llama), device="cpu", dtype=dtype)
        try:
            outputs[dtype] = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    for stored, full in zip(outputs["auto"], outputs["float32"], strict=True):
        assert stored.token_ids == full.token_ids
        for a, b in zip(stored.logprobs, full.logprobs, strict=True):
            for token, p in a.items():
                assert p.logprob == pytest.approx(b[token].logprob, abs=1e-4)

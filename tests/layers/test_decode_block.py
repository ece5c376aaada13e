"""The one-call decode blocks (strata/layers/decode_block.py) compute exactly what the modules compute, and serve
only the steps and layers their kernels can take."""
from __future__ import annotations

import pytest
import torch
from checkpoints import make_llama

from strata import LLM, SamplingParams
from strata import config as config_module
from strata.kernels.cpu import decode_layer
from strata.layers.decode_block import FusedDecodeLayer
from strata.layers.decode_forward import FusedDecodeForward
from strata.layers.decode_stack import FusedDecodeStack

PROMPTS = [{"prompt_token_ids": list(range(3 + i, 9 + 3 * i))} for i in range(3)]


@pytest.fixture(scope="module")
def llama_with_biases(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("decode_block"), attention_bias=True, mlp_bias=True, num_layers=3)


def _spy(monkeypatch) -> list[bool]:
    served, original = [], FusedDecodeLayer.serves_rows
    monkeypatch.setattr(FusedDecodeLayer, "serves_rows", lambda self, rows, meta: served.append(
        original(self, rows, meta)) or served[-1])
    return served


def _count_served(monkeypatch, cls: type) -> list:
    calls, original = [], cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *args: calls.append(original(self, *args)) or calls[-1])
    return calls


def _modules_only(monkeypatch) -> None:
    """Every fused path off: the stack and the whole step keep the plans they described, so each is switched off."""
    monkeypatch.setattr(FusedDecodeForward, "__call__", lambda self, *args: None)
    monkeypatch.setattr(FusedDecodeStack, "__call__", lambda self, *args: None)
    monkeypatch.setattr(FusedDecodeLayer, "serves_rows", lambda self, rows, meta: False)


def _generate(llm: LLM, n: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate(PROMPTS[:n], params, use_tqdm=False)]


def _assert_same_outputs(fused: list, plain: list) -> None:
    """The same tokens, and the same logprobs to the last bit, in every output."""
    for a, b in zip(fused, plain, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert {t: p.logprob for t, p in la.items()} == {t: p.logprob for t, p in lb.items()}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("path", ["whole step", "stack", "blocks"])
def test_fused_decode_gives_the_modules_tokens_and_logprobs_exactly(llama_with_biases, monkeypatch, batch, path):
    """Each fused path: the whole step in one call (embedding to argmax), all layers in one call (the stack), and one
    call per block (the stack's fallback)."""
    if decode_layer.library() is None or decode_layer.kernels() is None:
        pytest.skip("no C compiler")
    llm = LLM(str(llama_with_biases), device="cpu")
    try:
        served = _spy(monkeypatch)
        whole, stacked = _count_served(monkeypatch, FusedDecodeForward), _count_served(monkeypatch, FusedDecodeStack)
        if path != "whole step":
            monkeypatch.setattr(FusedDecodeForward, "__call__", lambda self, *args: None)
        if path == "blocks":
            monkeypatch.setattr(FusedDecodeStack, "__call__", lambda self, *args: None)
        fused = _generate(llm, batch)
        assert served and all(served[len(served) // 2:])  # every layer of the decode steps took it
        taken = {"whole step": whole, "stack": stacked, "blocks": []}[path]
        if path != "blocks":  # the 11 decode steps (a prefill goes through the modules)
            assert sum(s is not None for s in taken) == 11
        _modules_only(monkeypatch)
        plain = _generate(llm, batch)
    finally:
        llm.shutdown()
    _assert_same_outputs(fused, plain)


def test_prefill_steps_and_batches_past_the_kernels_keep_the_modules_path(llama_with_biases, monkeypatch):
    llm = LLM(str(llama_with_biases), device="cpu")
    try:
        served = _spy(monkeypatch)
        prompts = [{"prompt_token_ids": list(range(3, 9 + i))} for i in range(5)]  # 5 decodes: dense kernels take 3
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert served and not any(served)


def test_the_whole_step_reads_a_bfloat16_tied_table_and_grows_its_rotary_tables(tmp_path, monkeypatch):
    """A bfloat16 checkpoint (float32 compute, weights kept in bfloat16, as on a CPU without native bfloat16) with a
    tied head and llama3 rope scaling, decoding across position 256, where the rotary tables it looks up first end."""
    if decode_layer.library() is None or decode_layer.kernels() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(config_module, "cpu_has_native_bfloat16", lambda: False)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = make_llama(tmp_path / "bf16", tied=True, dtype=torch.bfloat16, rope_scaling=scaling, num_layers=2)
    prompts = [{"prompt_token_ids": [(7 * i) % 300 + 2 for i in range(250)]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm = LLM(str(path), device="cpu", enable_prefix_caching=False)  # both runs prefill the whole prompt alike
    try:
        whole = _count_served(monkeypatch, FusedDecodeForward)
        fused = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
        assert sum(s is not None for s in whole) == 11
        model = llm.engine.executor.runner.model.model
        assert model.embed_tokens.weight.dtype == torch.bfloat16
        assert model.layers[0].self_attn.rotary.float_tables(1)[0].shape[0] == 512  # grown once, past 256
        _modules_only(monkeypatch)
        plain = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    _assert_same_outputs([fused], [plain])


def test_a_bfloat16_kv_cache_under_a_float32_model_decodes_through_the_whole_step_as_the_modules(llama_with_biases,
                                                                                                  monkeypatch):
    """kv_cache_dtype=bfloat16: half the bytes a block, and the one-call step reads and writes that cache exactly as
    the modules' attention does."""
    if decode_layer.library() is None or decode_layer.kernels() is None:
        pytest.skip("no C compiler")
    memory = 1 << 20
    float_cache = LLM(str(llama_with_biases), device="cpu", kv_cache_memory=memory)
    float_blocks = float_cache.engine.executor.runner.attention_layers[0].k_cache.shape[0]
    float_cache.shutdown()
    llm = LLM(str(llama_with_biases), device="cpu", kv_cache_memory=memory, kv_cache_dtype="bfloat16")
    try:
        layer = llm.engine.executor.runner.attention_layers[0]
        assert layer.k_cache.dtype == layer.v_cache.dtype == torch.bfloat16
        assert layer.k_cache.shape[0] == 2 * float_blocks  # the same memory holds twice the tokens
        whole = _count_served(monkeypatch, FusedDecodeForward)
        fused = _generate(llm, 1)
        assert sum(s is not None for s in whole) == 11
        _modules_only(monkeypatch)
        plain = _generate(llm, 1)
    finally:
        llm.shutdown()
    _assert_same_outputs(fused, plain)

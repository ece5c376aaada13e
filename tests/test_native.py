"""Without a C compiler strata warns and runs its plain-torch paths, which give the same tokens; STRATA_KERNEL_MARCH
builds for a named x86-64 level, or is refused."""
from __future__ import annotations

import logging

import pytest
import torch

from strata import LLM, SamplingParams, native
from strata.errors import ConfigError
from strata.layers import cpu_attention, onednn_weights
from strata.layers.quantization import cpu_matmul


def test_a_missing_compiler_is_a_warning_and_no_library(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="strata.native"):
            assert native.load("cpu_attention") is None
        assert any("plain-torch path" in r.getMessage() for r in caplog.records)
    finally:
        native.load.cache_clear()


def test_plain_torch_paths_give_the_tokens_of_the_cpu_kernels(llama_gqa, monkeypatch):
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = []
    for module, name in ((cpu_matmul, "matmul"), (onednn_weights, "small_batch_linear")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, kernel=kernel, **kw: calls.append(1) or kernel(*args, **kw))

    def tokens() -> list[list[int]]:
        llm = LLM(str(llama_gqa), dtype="float32", device="cpu", max_model_len=128)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    with_kernels = tokens()
    assert calls, "decode steps of up to 3 sequences should run the C matmul kernels"
    monkeypatch.setattr(cpu_attention, "_library", lambda: None)  # decode attention gathers the blocks
    monkeypatch.setattr(cpu_matmul, "_library", lambda: None)  # linear layers run oneDNN / F.linear
    monkeypatch.setattr(onednn_weights, "_library", lambda: None)
    calls.clear()
    assert tokens() == with_kernels
    assert not calls


def test_kernel_march_builds_for_an_x86_64_level_in_its_own_cache_file(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_KERNEL_MARCH", "x86-64-v3")
    try:
        assert "-march=x86-64-v3" in native.compiler_flags()
    except ConfigError:
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    monkeypatch.delenv("STRATA_KERNEL_MARCH")
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load("rms_norm") is not None
        monkeypatch.setenv("STRATA_KERNEL_MARCH", "x86-64-v3")
        native.load.cache_clear()
        assert native.load("rms_norm") is not None
        assert len(list((tmp_path / "kernels").glob("rms_norm-*.so"))) == 2  # native's and x86-64-v3's, side by side
    finally:
        native.load.cache_clear()


def test_kernel_march_refuses_unknown_levels_and_levels_this_cpu_cannot_run(monkeypatch):
    monkeypatch.setenv("STRATA_KERNEL_MARCH", "skylake")
    with pytest.raises(ConfigError, match="expected one of native, x86-64-v2, x86-64-v3, x86-64-v4"):
        native.compiler_flags()
    monkeypatch.setenv("STRATA_KERNEL_MARCH", "x86-64-v4")
    monkeypatch.setattr(native, "_cpu_signature", lambda: "flags : fpu sse4_2 avx2 fma")
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    with pytest.raises(ConfigError, match="cannot run it .lacks avx512bw, avx512cd"):
        native.compiler_flags()

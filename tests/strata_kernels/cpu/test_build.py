"""Without a C compiler strata warns and runs its plain-torch paths, which give the same tokens; STRATA_KERNEL_MARCH
builds for a named x86-64 level, or is refused."""
from __future__ import annotations

import logging

import pytest
import torch

from strata import LLM, SamplingParams
from strata.errors import ConfigError
from strata.kernels.cpu import attention as cpu_attention
from strata.kernels.cpu import build
from strata.kernels.cpu import matmul as cpu_matmul
from strata.layers import onednn_weights


def test_a_missing_compiler_is_a_warning_and_no_library(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
    build.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="strata.kernels.cpu.build"):
            assert build.load("cpu_attention") is None
        assert any("plain-torch path" in r.getMessage() for r in caplog.records)
    finally:
        build.load.cache_clear()


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
    monkeypatch.setattr(cpu_attention, "decode_library", lambda: None)  # decode attention gathers the blocks
    monkeypatch.setattr(cpu_matmul, "weight_only_library", lambda: None)  # linear layers run oneDNN / F.linear
    monkeypatch.setattr(cpu_matmul, "blocked_library", lambda: None)
    calls.clear()
    assert tokens() == with_kernels
    assert not calls


def test_kernel_march_builds_for_an_x86_64_level_in_its_own_cache_file(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_KERNEL_MARCH", "x86-64-v3")
    try:
        assert "-march=x86-64-v3" in build.compiler_flags()
    except ConfigError:
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    monkeypatch.delenv("STRATA_KERNEL_MARCH")
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    build.load.cache_clear()
    try:
        assert build.load("rms_norm") is not None
        monkeypatch.setenv("STRATA_KERNEL_MARCH", "x86-64-v3")
        build.load.cache_clear()
        assert build.load("rms_norm") is not None
        assert len(list((tmp_path / "kernels").glob("rms_norm-*.so"))) == 2  # native's and x86-64-v3's, side by side
    finally:
        build.load.cache_clear()


def test_kernel_march_refuses_unknown_levels_and_levels_this_cpu_cannot_run(monkeypatch):
    monkeypatch.setenv("STRATA_KERNEL_MARCH", "skylake")
    with pytest.raises(ConfigError, match="expected one of native, x86-64-v2, x86-64-v3, x86-64-v4"):
        build.compiler_flags()
    monkeypatch.setenv("STRATA_KERNEL_MARCH", "x86-64-v4")
    monkeypatch.setattr(build, "_cpu_signature", lambda: "flags : fpu sse4_2 avx2 fma")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    with pytest.raises(ConfigError, match="cannot run it .lacks avx512bw, avx512cd"):
        build.compiler_flags()

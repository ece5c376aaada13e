"""Without a C compiler strata warns and runs its plain-torch paths, which give the same tokens."""
from __future__ import annotations

import logging

import torch

from strata import LLM, SamplingParams, native
from strata.layers import cpu_attention, embedding, linear


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

    def tokens(packed: bool) -> list[list[int]]:
        llm = LLM(str(llama_gqa), dtype="float32", device="cpu", max_model_len=128)
        model = llm.engine.executor.runner.model
        assert any(p.is_mkldnn for p in model.parameters()) == packed
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    with_kernels = tokens(packed=True)
    monkeypatch.setattr(cpu_attention, "_library", lambda: None)  # decode attention gathers the blocks
    for module in (linear, embedding):  # weights stay plain, for F.linear
        monkeypatch.setattr(module, "can_pack", lambda weight: False)
    assert tokens(packed=False) == with_kernels

"""dtype=auto on CPUs without native bfloat16 computes bfloat16 checkpoints in float32 (their linear weights kept
in bfloat16), and says so; kv_cache_dtype names the cache's dtype, or is refused."""
from __future__ import annotations

import logging

import pytest
import torch
from checkpoints import make_llama

from strata import config as config_module
from strata.config import EngineConfig
from strata.config.engine_args import EngineArgs
from strata.errors import ConfigError


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("bf16_llama"), dtype=torch.bfloat16)


@pytest.mark.parametrize("native", [False, True])
def test_auto_dtype_of_a_bfloat16_checkpoint_depends_on_native_bfloat16(bf16_llama, monkeypatch, caplog, native):
    monkeypatch.setattr(config_module, "cpu_has_native_bfloat16", lambda: native)
    with caplog.at_level(logging.INFO, logger="strata.config"):
        config = EngineConfig.from_args(EngineArgs(model=str(bf16_llama), device="cpu"))
    assert config.model.dtype == (torch.bfloat16 if native else torch.float32)
    assert config.model.weight_dtype == (None if native else torch.bfloat16)
    said = any("no native bfloat16" in r.getMessage() for r in caplog.records)
    assert said != native


def test_explicit_bfloat16_is_kept_without_native_bfloat16(bf16_llama, monkeypatch):
    monkeypatch.setattr(config_module, "cpu_has_native_bfloat16", lambda: False)
    config = EngineConfig.from_args(EngineArgs(model=str(bf16_llama), device="cpu", dtype="bfloat16"))
    assert config.model.dtype == torch.bfloat16 and config.model.weight_dtype is None


def test_kv_cache_dtype_is_the_model_dtype_or_bfloat16_and_fp8_is_refused(bf16_llama):
    config = EngineConfig.from_args(EngineArgs(model=str(bf16_llama), device="cpu", dtype="float32"))
    assert config.cache.kv_dtype(config.model.dtype) == torch.float32
    config = EngineConfig.from_args(EngineArgs(model=str(bf16_llama), device="cpu", dtype="float32",
                                               kv_cache_dtype="bfloat16"))
    assert config.cache.kv_dtype(config.model.dtype) == torch.bfloat16
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8' is not supported"):
        EngineConfig.from_args(EngineArgs(model=str(bf16_llama), device="cpu", kv_cache_dtype="fp8"))

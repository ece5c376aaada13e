"""The fused CPU decode backend (strata/executor/cpu_decode.py): built by the runner only on CPU and only for models
whose stage layers are declared decoder layers, decided from declarations and never by comparing a model's methods."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama
from llama4_checkpoints import make_llama4_text
from mamba_checkpoints import make_mamba2

from strata.config import EngineConfig
from strata.distributed import ParallelContext
from strata.executor.cpu_decode import CpuDecode
from strata.executor.model_runner import ModelRunner

STRATA = Path(__file__).resolve().parents[2] / "strata"


def _meta_model(path: Path, pc: ParallelContext | None = None) -> torch.nn.Module:
    """The checkpoint's model built on the meta device (no weights read)."""
    config = EngineConfig.create(str(path), dtype="float32", device="cpu")
    with torch.device("meta"):
        return config.model.info.load_class()(config.model, pc or ParallelContext())


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("cpu_decode_llama"), num_layers=2)


def test_the_backend_is_built_on_cpu_only(llama):
    model = _meta_model(llama)
    backend = CpuDecode.build(model, torch.device("cpu"))
    assert isinstance(backend, CpuDecode) and backend.whole_step is not None
    assert len(backend.stack.fused) == 2
    for device in ("meta", "cuda"):
        assert CpuDecode.build(model, torch.device(device)) is None


def test_a_pipeline_stage_gets_the_stack_without_the_whole_step(llama):
    first = CpuDecode.build(_meta_model(llama, ParallelContext(pp_rank=0, pp_size=2)), torch.device("cpu"))
    last = CpuDecode.build(_meta_model(llama, ParallelContext(pp_rank=1, pp_size=2)), torch.device("cpu"))
    assert first.whole_step is None and first.stack.final_norm is None
    assert last.whole_step is None and last.stack.final_norm is not None


def test_models_without_declared_layers_get_no_backend(tmp_path):
    """Llama 4 (its own attention) and Mamba2 (no attention) keep their forward: no fused decode path."""
    for path in (make_llama4_text(tmp_path / "llama4"), make_mamba2(tmp_path / "mamba2")):
        assert CpuDecode.build(_meta_model(path), torch.device("cpu")) is None


def test_the_runner_asks_the_backend_it_built_and_none_off_cpu(llama, monkeypatch):
    config = EngineConfig.create(str(llama), dtype="float32", device="cpu")
    assert isinstance(ModelRunner(config, ParallelContext(), torch.device("cpu")).cpu_decode, CpuDecode)
    built = []
    original = CpuDecode.build.__func__
    monkeypatch.setattr(CpuDecode, "build", classmethod(lambda cls, model, device: built.append(device) or
                                                         original(cls, model, torch.device("meta"))))
    assert ModelRunner(config, ParallelContext(), torch.device("cpu")).cpu_decode is None
    assert built == [torch.device("cpu")]


def test_no_model_method_is_compared_by_identity():
    """Which path a step takes is decided from declared fields: nothing in strata tells whether a subclass overrode
    a method by comparing functions (`type(self).forward is not CausalLM.forward`)."""
    identity = re.compile(r"(type\([^)]*\)|\bcls)\.\w+\s*(is|==|!=|in)\s|\bCausalLM\.\w+\s*(is|==|!=|\)|,)"
                          r"|\bis\s+(not\s+)?\w+\.(forward|finish|compute_logits|embed_input_ids)\b")
    found = [f"{path.relative_to(STRATA.parent)}:{n}: {line.strip()}"
             for path in sorted(STRATA.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if identity.search(line)]
    assert not found, "\n".join(found)

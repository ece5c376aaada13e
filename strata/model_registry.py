"""Architecture name -> model class and what it can do; the one place capabilities are looked up.

A leaf module: config validation reads the capabilities, and model classes are imported by name only when
a model is built, so nothing here depends on `strata.models`. Adding an architecture is one line in `_MODELS`."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from strata.errors import UnsupportedModelError


@dataclass(frozen=True)
class ModelInfo:
    module: str
    class_name: str
    supports_pp: bool = True
    supports_tp: bool = True
    is_hybrid: bool = False  # keeps per-request recurrent state (Mamba) besides or instead of a KV cache
    is_multimodal: bool = False
    # For multimodal checkpoints: the architecture of the language sub-model, whose capabilities count.
    text_architecture: str | None = None

    def load_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)


_MODELS: dict[str, ModelInfo] = {
    "LlamaForCausalLM": ModelInfo("strata.models.llama", "LlamaForCausalLM"),
    "Llama4ForCausalLM": ModelInfo("strata.models.llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ModelInfo("strata.models.llama4_vision", "Llama4ForConditionalGeneration",
                                                is_multimodal=True, text_architecture="Llama4ForCausalLM"),
    "Mamba2ForCausalLM": ModelInfo("strata.models.mamba2", "Mamba2ForCausalLM", is_hybrid=True),
    "Plamo2ForCausalLM": ModelInfo("strata.models.plamo2", "Plamo2ForCausalLM", is_hybrid=True),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def lookup(architecture: str | None) -> ModelInfo:
    if architecture not in _MODELS:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}",
            param="architectures",
        )
    return _MODELS[architecture]


def text_model_info(architecture: str) -> ModelInfo:
    """Capabilities of the model that runs the tokens: the language sub-model for multimodal ones."""
    info = lookup(architecture)
    return lookup(info.text_architecture) if info.text_architecture else info

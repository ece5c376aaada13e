"""Architecture name -> model class and what it can do; the one place capabilities are looked up.

A leaf module: config validation reads the capabilities, and model classes are imported by name only when
a model is built, so nothing here depends on `strata.models`. Adding an architecture is one line in `_MODELS`."""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from strata.errors import UnsupportedModelError

logger = logging.getLogger(__name__)


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
    is_encoder: bool = False  # bidirectional, no KV cache: served by the pooling runner (embeddings)
    # A decoder served only as a classifier (*ForSequenceClassification: a `score` head, or Qwen3-Reranker's yes/no
    # logits), by the pooling runner.
    is_classifier: bool = False

    @property
    def pooling_only(self) -> bool:
        """Served by the pooling runner alone: it cannot generate text."""
        return self.is_encoder or self.is_classifier

    def load_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)


_MODELS: dict[str, ModelInfo] = {
    "LlamaForCausalLM": ModelInfo("strata.models.llama", "LlamaForCausalLM"),
    "Llama4ForCausalLM": ModelInfo("strata.models.llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ModelInfo("strata.models.llama4_vision", "Llama4ForConditionalGeneration",
                                                is_multimodal=True, text_architecture="Llama4ForCausalLM"),
    "Mamba2ForCausalLM": ModelInfo("strata.models.mamba2", "Mamba2ForCausalLM", is_hybrid=True),
    "Qwen2ForCausalLM": ModelInfo("strata.models.dense_decoder", "Qwen2ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ModelInfo("strata.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
                                                    is_multimodal=True, text_architecture="Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ModelInfo("strata.models.dense_decoder", "Qwen3ForCausalLM"),
    "Qwen3ForSequenceClassification": ModelInfo("strata.models.dense_decoder", "Qwen3ForCausalLM", supports_pp=False,
                                                is_classifier=True),
    # A decoder's classification head (`score`) over its last token (vLLM's --convert classify).
    "LlamaForSequenceClassification": ModelInfo("strata.models.llama", "LlamaForCausalLM", supports_pp=False,
                                                is_classifier=True),
    "Qwen2ForSequenceClassification": ModelInfo("strata.models.dense_decoder", "Qwen2ForCausalLM", supports_pp=False,
                                                is_classifier=True),
    "Qwen3MoeForCausalLM": ModelInfo("strata.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MistralForCausalLM": ModelInfo("strata.models.dense_decoder", "MistralForCausalLM"),
    "Phi3ForCausalLM": ModelInfo("strata.models.phi3", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ModelInfo("strata.models.granite", "GraniteForCausalLM"),
    "Gemma2ForCausalLM": ModelInfo("strata.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ModelInfo("strata.models.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ModelInfo("strata.models.gemma3_vision", "Gemma3ForConditionalGeneration",
                                                is_multimodal=True, text_architecture="Gemma3ForCausalLM"),
    "GptOssForCausalLM": ModelInfo("strata.models.gpt_oss", "GptOssForCausalLM"),
    "Plamo2ForCausalLM": ModelInfo("strata.models.plamo2", "Plamo2ForCausalLM", is_hybrid=True),
    "BertModel": ModelInfo("strata.models.bert", "BertModel", supports_pp=False, is_encoder=True),
    "BertForSequenceClassification": ModelInfo("strata.models.bert", "BertForSequenceClassification",
                                               supports_pp=False, is_encoder=True),
    "ModernBertModel": ModelInfo("strata.models.modernbert", "ModernBertModel", supports_pp=False, is_encoder=True),
    "XLMRobertaModel": ModelInfo("strata.models.xlm_roberta", "XLMRobertaModel", supports_pp=False, is_encoder=True),
    "XLMRobertaForSequenceClassification": ModelInfo("strata.models.xlm_roberta",
                                                     "XLMRobertaForSequenceClassification", supports_pp=False,
                                                     is_encoder=True),
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


# Model types whose classes transformers does not ship (remote code), as their checkpoints name them.
_OWN_MODEL_TYPES = {"plamo2": "Plamo2ForCausalLM"}
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText")


def architecture_of(config: Any) -> str:
    """The architecture a config.json (any object with `.get`) names in `architectures`, else the one implied
    where that is unambiguous: its `auto_map` (remote code), or its `model_type` as transformers' Auto classes map
    it. Unsupported or unknowable architectures are refused, saying how to name one."""
    named = config.get("architectures")
    if named:
        if not isinstance(named, list) or not isinstance(named[0], str):
            raise UnsupportedModelError(f'config.json\'s "architectures" must be a list of class names such as '
                                        f'["LlamaForCausalLM"], got {named!r}', param="architectures")
        lookup(named[0])
        return named[0]
    model_type = config.get("model_type")
    candidates = _implied_architectures(config, model_type)
    if "vision_config" in config or "text_config" in config:
        multimodal = [a for a in candidates if _MODELS[a].is_multimodal]
        candidates = multimodal or candidates
    else:
        candidates = [a for a in candidates if not _MODELS[a].is_multimodal]
    if len(candidates) == 1:
        logger.info("config.json names no architectures; model_type %r means %s", model_type, candidates[0])
        return candidates[0]
    found = (f"its model_type {model_type!r} fits several: {', '.join(candidates)}" if candidates else
             f"its model_type {model_type!r} names no supported architecture" if model_type else
             "nor a model_type to infer one from")
    raise UnsupportedModelError(
        f'config.json has no "architectures" field, and {found}. Add the model class to config.json, e.g. '
        f'"architectures": ["{candidates[0] if candidates else "LlamaForCausalLM"}"] (supported: '
        f"{', '.join(supported_architectures())})", param="architectures")


def _implied_architectures(config: Any, model_type: Any) -> list[str]:
    """Supported architectures that `auto_map` or `model_type` point at, without duplicates."""
    auto_map = config.get("auto_map")
    names = [str(auto_map[c]).rsplit(".", 1)[-1] for c in _AUTO_CLASSES
             if isinstance(auto_map, dict) and c in auto_map]
    if isinstance(model_type, str):
        names.append(_OWN_MODEL_TYPES.get(model_type, ""))
        names += _transformers_classes(model_type)
    return [name for name in dict.fromkeys(names) if name in _MODELS]


def _transformers_classes(model_type: str) -> list[str]:
    # Imported only here: transformers takes seconds to import, and most checkpoints name their architecture.
    from transformers.models.auto import modeling_auto

    maps = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return [m[model_type] for m in maps if model_type in m]

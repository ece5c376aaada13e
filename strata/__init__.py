"""strata: serve large language models with continuous batching, a paged KV cache, TP and PP."""
from __future__ import annotations

from strata.errors import (
    AuthError,
    ConfigError,
    EngineDeadError,
    NotFoundError,
    RequestError,
    StrataError,
    UnsupportedModelError,
)
from strata.lora.request import LoRARequest
from strata.outputs import CompletionOutput, Logprob, RequestOutput
from strata.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # Importing torch and transformers is slow; `strata --help` should not pay for it.
    if name == "LLM":
        from strata.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "StrataError", "ConfigError", "UnsupportedModelError", "RequestError", "NotFoundError",
           "AuthError", "EngineDeadError"]

"""Llama (1, 2, 3.x): pre-norm decoder layers of GQA attention with RoPE and a SwiGLU MLP, optional biases; the
layers are `dense_decoder`'s, which its descendants share."""
from __future__ import annotations

from dataclasses import dataclass

from strata.config import HFConfig
from strata.models.base import ModelArgs
from strata.models.dense_decoder import DenseArgs, DenseCausalLM


@dataclass(frozen=True, kw_only=True)
class LlamaArgs(DenseArgs):
    attention_bias: bool = False  # on q, k, v and o

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> LlamaArgs:
        bias = bool(cfg.get("attention_bias", False))
        return cls(**ModelArgs.common(cfg), **DenseArgs.attention(cfg), attention_bias=bias, qkv_bias=bias,
                   o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


class LlamaForCausalLM(DenseCausalLM):
    args: LlamaArgs
    args_class = LlamaArgs

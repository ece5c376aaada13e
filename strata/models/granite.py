"""Granite (3.x dense): Llama's layers with four multipliers: embeddings scaled up, the attention scale set, each
block's output scaled before the residual add, the logits scaled down."""
from __future__ import annotations

from dataclasses import dataclass

from strata.config import HFConfig
from strata.models.base import ModelArgs
from strata.models.dense_decoder import DenseArgs, DenseCausalLM


@dataclass(frozen=True, kw_only=True)
class GraniteArgs(DenseArgs):
    @classmethod
    def from_hf(cls, cfg: HFConfig) -> GraniteArgs:
        bias = bool(cfg.get("attention_bias", False))
        return cls(**ModelArgs.common(cfg), **DenseArgs.attention(cfg), qkv_bias=bias, o_bias=bias,
                   mlp_bias=bool(cfg.get("mlp_bias", False)),
                   attention_scale=float(cfg.get("attention_multiplier", 1.0)),
                   residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                   embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                   logits_scaling=float(cfg.get("logits_scaling", 1.0)))


class GraniteForCausalLM(DenseCausalLM):
    """The multipliers are ModelArgs' and DenseArgs' own, which the CPU decode path applies too."""

    args: GraniteArgs
    args_class = GraniteArgs

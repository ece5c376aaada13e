"""Phi-3 (mini, medium; Phi-3.5-mini, Phi-4-mini): Llama's layers with q/k/v and gate/up fused in the checkpoint,
partial rotary embeddings and LongRoPE scaling, and a sliding window on every layer when the config sets one."""
from __future__ import annotations

from dataclasses import dataclass

from strata.config import HFConfig
from strata.layers.rotary import partial_rotary_factor
from strata.models.base import ModelArgs
from strata.models.dense_decoder import DenseArgs, DenseCausalLM


@dataclass(frozen=True, kw_only=True)
class Phi3Args(DenseArgs):
    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Phi3Args:
        attention = DenseArgs.attention(cfg)
        window = cfg.get("sliding_window")
        return cls(**ModelArgs.common(cfg, eps=1e-5), **attention,
                   rotary_dim=int(attention["head_dim"] * partial_rotary_factor(cfg)),
                   windows=(window,) * cfg.num_hidden_layers)


class Phi3ForCausalLM(DenseCausalLM):
    args_class = Phi3Args
    # The checkpoint stores qkv_proj and gate_up_proj fused: each tensor loads whole into its layer, which cuts
    # the q, k, v (gate, up) rows apart before taking this rank's share of each.
    stacked_params = []

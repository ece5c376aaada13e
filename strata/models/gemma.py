"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP arranged as a "sandwich": every block's input and
output are normalised (four RMSNorms a layer, each scaling by 1 + w), embeddings are scaled by sqrt(hidden), the MLP
gates with tanh-approximated GELU and attention scales by query_pre_attn_scalar ** -0.5 rather than head_dim's. The
layer declares where its norms sit (DecoderLayerSpec); the embedding scale and the final soft cap are ModelArgs fields
that CausalLM applies.

Local (sliding-window) and global layers alternate: one to one in Gemma 2, five to one in Gemma 3. Gemma 2 bends
attention scores and final logits through cap * tanh(x / cap); Gemma 3 drops that for per-head q/k norms and gives
its local layers their own rotary base. Gemma 3 with images: strata/models/gemma3_vision.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from strata.config import HFConfig
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.attention import Attention
from strata.layers.decoder_layer import DecoderLayer, DecoderLayerSpec, GatedMLP
from strata.layers.norm import GemmaRMSNorm
from strata.layers.rotary import RotaryEmbedding, rope_parameters
from strata.models.base import CausalLM, ModelArgs
from strata.models.dense_decoder import QKV_GATE_UP, DenseArgs, DenseAttention

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True, kw_only=True)
class GemmaArgs(DenseArgs):
    local_rope_theta: float  # the rotary base (and scaling) of sliding-window layers
    local_rope_scaling: dict[str, Any] | None = None

    @staticmethod
    def gemma(cfg: HFConfig, *, softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
        """The keys both generations read; `softcaps`: the (attention, final) caps when config.json omits them."""
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU_TANH:
            raise UnsupportedModelError(f"hidden_activation {act!r} is not supported by Gemma models (their MLPs "
                                        "gate with gelu_pytorch_tanh)", param="hidden_activation")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention (an encoder's attention) is not supported; "
                                        "strata serves causal language models", param="use_bidirectional_attention")
        heads, bias = cfg.num_attention_heads, bool(cfg.get("attention_bias", False))
        attn_cap, final_cap = (cfg.get(key, default) for key, default in
                               zip(("attn_logit_softcapping", "final_logit_softcapping"), softcaps, strict=True))
        return dict(**ModelArgs.common(cfg, tied=True), embedding_multiplier=math.sqrt(cfg.hidden_size),
                    intermediate_size=cfg.intermediate_size, num_heads=heads,
                    num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or 256,
                    qkv_bias=bias, o_bias=bias,
                    attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                    attn_softcap=None if attn_cap is None else float(attn_cap),
                    final_softcap=None if final_cap is None else float(final_cap))


def layer_windows(cfg: HFConfig, sliding_every: int) -> tuple[int | None, ...]:
    """Each layer's window: where `layer_types` marks it sliding or, without that list, on all layers but every
    `sliding_every`-th (transformers' rule for configs written before layer_types)."""
    window = cfg.get("sliding_window") or 4096
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % sliding_every == 0 else "sliding_attention"
                                       for i in range(cfg.num_hidden_layers)]
    return tuple(window if kind == "sliding_attention" else None for kind in types)


@dataclass(frozen=True, kw_only=True)
class Gemma2Args(GemmaArgs):
    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Gemma2Args:
        theta, scaling = rope_parameters(cfg)
        return cls(**GemmaArgs.gemma(cfg, softcaps=(50.0, 30.0)), windows=layer_windows(cfg, 2), rope_theta=theta,
                   rope_scaling=scaling, local_rope_theta=theta, local_rope_scaling=scaling)


def gemma3_rope(cfg: HFConfig) -> dict[str, Any]:
    """Global and local layers' rotary bases and scalings: transformers 5 nests them by layer type in
    `rope_parameters`; older configs give rope_theta / rope_scaling (global) and rope_local_base_freq (local)."""
    nested = cfg.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        def of(kind: str) -> tuple[float, dict[str, Any] | None]:
            return rope_parameters(HFConfig({"rope_parameters": nested.get(kind) or {},
                                             "max_position_embeddings": cfg.get("max_position_embeddings")}))
        (theta, scaling), (local, local_scaling) = of("full_attention"), of("sliding_attention")
    else:
        theta, scaling = rope_parameters(cfg)
        local, local_scaling = cfg.get("rope_local_base_freq", 10000.0), None
    return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local, local_rope_scaling=local_scaling)


@dataclass(frozen=True, kw_only=True)
class Gemma3Args(GemmaArgs):
    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Gemma3Args:
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return cls(**GemmaArgs.gemma(cfg, softcaps=(None, None)), **gemma3_rope(cfg), qk_norm=True,
                   windows=layer_windows(cfg, every))


class GemmaDecoderLayer(DecoderLayer):
    """Normalised attention and MLP blocks, each normalised again before it joins the residual stream: Gemma's
    post_attention_layernorm is the attention block's out-norm, its pre_feedforward_layernorm the norm before the
    MLP (the one that adds the residual)."""

    def __init__(self, a: GemmaArgs, index: int, pc: ParallelContext, dtype: torch.dtype,
                 rotary: RotaryEmbedding, attention: type[Attention] = Attention) -> None:
        super().__init__()
        self.self_attn = DenseAttention(a, a.window(index), pc, dtype, rotary, norm=GemmaRMSNorm, attention=attention)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, pc, dtype, activation="gelu_tanh")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            self.add_module(name, GemmaRMSNorm(a.hidden_size, a.norm_eps, dtype))
        self.spec = DecoderLayerSpec(**self.self_attn.parts(), input_norm=self.input_layernorm,
                                     attention_out_norm=self.post_attention_layernorm,
                                     feed_forward_norm=self.pre_feedforward_layernorm, feed_forward=self.mlp,
                                     feed_forward_out_norm=self.post_feedforward_layernorm,
                                     output_scale=a.residual_multiplier)


class GemmaCausalLM(CausalLM):
    args: GemmaArgs
    stacked_params = QKV_GATE_UP
    norm_class = GemmaRMSNorm
    ignored_weights = ("rotary_emb.inv_freq",)
    attention_class: type[Attention] = Attention  # the multimodal model's lets an image's tokens see each other

    def make_layer(self, index: int) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(self.args, index, self.pc, self.dtype, self._rotary(self.args.window(index)),
                                 self.attention_class)

    def _rotary(self, window: int | None) -> RotaryEmbedding:
        """One rotary embedding per kind of layer (local, global), shared by the layers of that kind so that its
        cos/sin are computed once per step."""
        a, local = self.args, window is not None
        if not hasattr(self, "rotaries"):
            self.rotaries: dict[bool, RotaryEmbedding] = {}
        if local not in self.rotaries:
            theta, scaling = (a.local_rope_theta, a.local_rope_scaling) if local else (a.rope_theta, a.rope_scaling)
            self.rotaries[local] = RotaryEmbedding(a.head_dim, theta, scaling, max_model_len=self.max_model_len)
        return self.rotaries[local]


class Gemma2ForCausalLM(GemmaCausalLM):
    args_class = Gemma2Args


class Gemma3ForCausalLM(GemmaCausalLM):
    args_class = Gemma3Args

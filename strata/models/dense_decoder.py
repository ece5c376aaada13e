"""Llama's decoder and its descendants that differ from it only by flags: q/k/v biases (Qwen2), per-head q/k RMSNorm
and an explicit head_dim (Qwen3), sliding windows on some layers or all (Qwen2, Qwen3, Mistral); Llama, Phi-3, Granite
and Qwen3-MoE build on the attention and decoder layer here, which declare themselves (`DecoderLayerSpec`) to the one
torch interpreter and to the CPU decode backend alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strata.config import HFConfig
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.attention import Attention
from strata.layers.decoder_layer import DecoderLayer, DecoderLayerSpec, GatedMLP
from strata.layers.linear import QKVParallelLinear, RowParallelLinear
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding, rope_parameters
from strata.models.base import CausalLM, ModelArgs

# Checkpoints store q, k, v and gate, up separately; they load into one fused projection each.
QKV_GATE_UP: list[tuple[str, str, object]] = [
    (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1),
]


@dataclass(frozen=True, kw_only=True)
class DenseArgs(ModelArgs):
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int | None = None  # the leading dimensions of a head that rotate; None: all of them
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before the rotation
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (keys a token sees, itself included)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    residual_multiplier: float = 1.0  # scales each block's output before it joins the residual stream
    attn_softcap: float | None = None  # attention scores become cap * tanh(scores / cap) (Gemma 2)

    @staticmethod
    def attention(cfg: HFConfig, head_dim: int | None = None) -> dict[str, Any]:
        """The keys every one of these architectures reads as Llama does; `head_dim` when the config has none."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported by {cfg.get('model_type')} "
                                        "models (their MLPs are SwiGLU: silu)", param="hidden_act")
        heads = cfg.num_attention_heads
        theta, scaling = rope_parameters(cfg)
        return dict(intermediate_size=cfg.intermediate_size, num_heads=heads,
                    num_kv_heads=cfg.get("num_key_value_heads") or heads,
                    head_dim=cfg.get("head_dim") or head_dim or cfg.hidden_size // heads, rope_theta=theta,
                    rope_scaling=scaling)

    def window(self, index: int) -> int | None:
        return self.windows[index] if self.windows else None


def qwen_layer_windows(cfg: HFConfig) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3 (transformers' rule): a window only when `use_sliding_window`; then on the layers `layer_types`
    marks sliding, or without that list on every layer from `max_window_layers` on."""
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28) else "full_attention"
        for i in range(cfg.num_hidden_layers)]
    return tuple(window if kind == "sliding_attention" else None for kind in types)


@dataclass(frozen=True, kw_only=True)
class Qwen2Args(DenseArgs):
    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Qwen2Args:
        return cls(**ModelArgs.common(cfg), **DenseArgs.attention(cfg), qkv_bias=True,
                   windows=qwen_layer_windows(cfg))


@dataclass(frozen=True, kw_only=True)
class Qwen3Args(DenseArgs):
    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Qwen3Args:
        bias = bool(cfg.get("attention_bias", False))
        return cls(**ModelArgs.common(cfg), **DenseArgs.attention(cfg, head_dim=128), qkv_bias=bias, o_bias=bias,
                   qk_norm=True, windows=qwen_layer_windows(cfg))


@dataclass(frozen=True, kw_only=True)
class MistralArgs(DenseArgs):
    @classmethod
    def from_hf(cls, cfg: HFConfig) -> MistralArgs:
        window = cfg.get("sliding_window", 4096)  # transformers' default when the key is absent
        return cls(**ModelArgs.common(cfg), **DenseArgs.attention(cfg),
                   windows=(window,) * cfg.num_hidden_layers)


class DenseAttention(nn.Module):
    """The attention's modules under the checkpoint's names (q/k/v/o projections, per-head q/k norms) beside the
    shared rotary embedding and the paged attention (window, soft cap); `parts` declares them to the layer's spec."""

    def __init__(self, a: DenseArgs, window: int | None, pc: ParallelContext, dtype: torch.dtype,
                 rotary: RotaryEmbedding, norm: type[RMSNorm] = RMSNorm,
                 attention: type[Attention] = Attention) -> None:
        """`norm`: the class of the per-head q/k norms; `attention`: of the paged attention."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, pc, a.qkv_bias,
                                          dtype)
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, pc, a.o_bias, dtype=dtype)
        self.q_norm = norm(a.head_dim, a.norm_eps, dtype) if a.qk_norm else None
        self.k_norm = norm(a.head_dim, a.norm_eps, dtype) if a.qk_norm else None
        self.rotary = rotary  # one instance for all layers: its cos/sin tables are computed once per step
        scale = a.head_dim ** -0.5 if a.attention_scale is None else a.attention_scale
        self.attn = attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, a.head_dim, scale,
                              sliding_window=window, softcap=a.attn_softcap)

    def parts(self) -> dict[str, nn.Module | None]:
        """Its fields of a DecoderLayerSpec."""
        return dict(qkv_proj=self.qkv_proj, q_norm=self.q_norm, k_norm=self.k_norm, rotary=self.rotary,
                    attn=self.attn, o_proj=self.o_proj)


class DenseDecoderLayer(DecoderLayer):
    """Attention, then `mlp` (a SwiGLU MLP unless another block is given, e.g. routed experts), each behind an
    RMSNorm that adds the residual; both blocks' outputs scaled by `residual_multiplier` (Granite)."""

    def __init__(self, a: DenseArgs, index: int, pc: ParallelContext, dtype: torch.dtype, rotary: RotaryEmbedding,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = DenseAttention(a, a.window(index), pc, dtype, rotary)
        self.mlp = mlp if mlp is not None else GatedMLP(a.hidden_size, a.intermediate_size, pc, dtype, a.mlp_bias)
        self.input_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.spec = DecoderLayerSpec(**self.self_attn.parts(), input_norm=self.input_layernorm,
                                     feed_forward_norm=self.post_attention_layernorm, feed_forward=self.mlp,
                                     output_scale=a.residual_multiplier)


class DenseCausalLM(CausalLM):
    """A stack of `DenseDecoderLayer`s sharing one rotary embedding."""

    args: DenseArgs
    stacked_params = QKV_GATE_UP
    ignored_weights = ("rotary_emb.inv_freq",)

    def make_layer(self, index: int) -> DenseDecoderLayer:
        return DenseDecoderLayer(self.args, index, self.pc, self.dtype, self.shared_rotary())

    def shared_rotary(self) -> RotaryEmbedding:
        if getattr(self, "rotary", None) is None:
            a = self.args
            self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling, rotary_dim=a.rotary_dim,
                                          max_model_len=self.max_model_len)
        return self.rotary


class Qwen2ForCausalLM(DenseCausalLM):
    args_class = Qwen2Args


class Qwen3ForCausalLM(DenseCausalLM):
    args_class = Qwen3Args


class MistralForCausalLM(DenseCausalLM):
    args_class = MistralArgs

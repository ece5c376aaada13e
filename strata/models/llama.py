"""Llama (1, 2, 3.x): pre-norm decoder layers of GQA attention with RoPE and a SwiGLU MLP."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strata.config import HFConfig
from strata.distributed import ParallelContext
from strata.layers.activation import silu_and_mul
from strata.layers.attention import Attention, AttentionMetadata
from strata.layers.decode_block import FusedDecodeLayer
from strata.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding, rope_parameters
from strata.models.base import CausalLM, ModelArgs

# Checkpoints store q, k, v and gate, up separately; they load into one fused projection each.
QKV_GATE_UP: list[tuple[str, str, object]] = [
    (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1),
]


@dataclass(frozen=True, kw_only=True)
class LlamaArgs(ModelArgs):
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> LlamaArgs:
        heads = cfg.num_attention_heads
        theta, scaling = rope_parameters(cfg)
        return cls(**ModelArgs.common(cfg), intermediate_size=cfg.intermediate_size, num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg.hidden_size // heads, rope_theta=theta, rope_scaling=scaling,
                   attention_bias=cfg.get("attention_bias", False), mlp_bias=cfg.get("mlp_bias", False))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, pc: ParallelContext, dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, pc, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, pc, bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, pc: ParallelContext, dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim, bias = a.head_dim, a.attention_bias
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, pc, bias, dtype)
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, pc, bias, dtype=dtype)
        self.rotary = rotary  # one instance for all layers: its cos/sin tables are computed once per step
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, a.head_dim, a.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(x))
        t = x.shape[0]
        q, k = self.rotary(positions, q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim))
        return self.o_proj(self.attn(q, k, v.view(t, -1, self.head_dim), meta))


class PreNormDecoderLayer(nn.Module):
    """Attention then a feed-forward block, each behind an RMSNorm that also adds the residual carried in
    from the previous block. Subclasses build the modules and say which feed-forward block runs."""

    self_attn: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def feed_forward_block(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward_block(x), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, a: LlamaArgs, pc: ParallelContext, dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a, pc, dtype, rotary)
        self.mlp = LlamaMLP(a.hidden_size, a.intermediate_size, pc, dtype, a.mlp_bias)
        self.input_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.fused_decode = FusedDecodeLayer(self)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_decode.serves(x, meta):  # a CPU decode step: each block in one call, the same kernels
            return self.fused_decode(positions, x, residual, meta)
        return super().forward(positions, x, residual, meta)

    def feed_forward_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class LlamaForCausalLM(CausalLM):
    args: LlamaArgs
    args_class = LlamaArgs
    stacked_params = QKV_GATE_UP
    ignored_weights = ("rotary_emb.inv_freq",)

    def make_layer(self, index: int) -> LlamaDecoderLayer:
        if getattr(self, "rotary", None) is None:
            self.rotary = RotaryEmbedding(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling)
        return LlamaDecoderLayer(self.args, self.pc, self.dtype, self.rotary)

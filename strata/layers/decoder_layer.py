"""One declaration of a pre-norm decoder layer (`DecoderLayerSpec`: which module plays which part) and its one torch
interpreter (`run_decoder_layer`); the CPU decode backend (decode_block.py) reads the same declaration.

A model builds its layer's modules under the checkpoint's names and declares their roles (Gemma: its
post_attention_layernorm is the attention block's out-norm, its pre_feedforward_layernorm the norm before the MLP);
it sets fields (norms and where they sit, q/k norms, window, soft cap and sinks of the attention, output scale,
activation) instead of writing a forward.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.activation import gelu_tanh_and_mul, silu_and_mul
from strata.layers.attention import Attention, AttentionMetadata
from strata.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding

# A gated MLP's activation of [gate | up] -> act(gate) * up, by the name a declaration gives it.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": silu_and_mul,
                                                                   "gelu_tanh": gelu_tanh_and_mul}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one projection; `activation` names act (ACTIVATIONS): SwiGLU
    (silu, Llama) or tanh-GELU (Gemma)."""

    def __init__(self, hidden: int, intermediate: int, pc: ParallelContext, dtype: torch.dtype,
                 bias: bool = False, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"MLP activation {activation!r} is not supported (known: "
                                        f"{', '.join(ACTIVATIONS)})", param="hidden_act")
        self.activation = activation
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, pc, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, pc, bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_up_proj(x)))


@dataclass(frozen=True, kw_only=True)
class DecoderLayerSpec:
    """x -> input_norm (adding the residual carried in) -> qkv_proj -> q_norm / k_norm per head -> rotary -> attn
    (its window, soft cap and sinks) -> o_proj -> x output_scale -> attention_out_norm, then feed_forward_norm (adding
    it to the residual) -> feed_forward -> x output_scale -> feed_forward_out_norm. The out-norms are Gemma's
    "sandwich". `feed_forward`: a GatedMLP (the CPU decode path runs it in C) or any module (routed experts)."""

    input_norm: RMSNorm
    qkv_proj: QKVParallelLinear
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    rotary: RotaryEmbedding
    attn: Attention
    o_proj: RowParallelLinear
    attention_out_norm: RMSNorm | None = None
    feed_forward_norm: RMSNorm
    feed_forward: nn.Module
    feed_forward_out_norm: RMSNorm | None = None
    output_scale: float = 1.0  # each block's output before it joins the residual stream (Granite)

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("a decoder layer normalises both q and k per head, or neither")

    @property
    def mlp(self) -> GatedMLP | None:
        """The feed-forward block when it is a gated MLP, else None (a module of its own)."""
        return self.feed_forward if isinstance(self.feed_forward, GatedMLP) else None


def run_attention(spec: DecoderLayerSpec, positions: torch.Tensor, x: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
    """The attention block's output before its scale and out-norm: [T, hidden] (all-reduced by o_proj)."""
    q, k, v = spec.qkv_proj.split_qkv(spec.qkv_proj(x))
    t, head_dim = x.shape[0], spec.attn.head_dim
    q, k = q.view(t, -1, head_dim), k.view(t, -1, head_dim)
    if spec.q_norm is not None:
        q, k = spec.q_norm(q), spec.k_norm(k)
    q, k = spec.rotary(positions, q, k)
    return spec.o_proj(spec.attn(q, k, v.view(t, -1, head_dim), meta))


def finish_block(spec: DecoderLayerSpec, out: torch.Tensor, out_norm: RMSNorm | None) -> torch.Tensor:
    """A block's output as it joins the residual stream: scaled, then through its out-norm when there is one."""
    if spec.output_scale != 1.0:
        out = out * spec.output_scale
    return out if out_norm is None else out_norm(out)


def run_feed_forward(spec: DecoderLayerSpec, x: torch.Tensor) -> torch.Tensor:
    """The feed-forward block of normalised `x`, finished (scale, out-norm)."""
    return finish_block(spec, spec.feed_forward(x), spec.feed_forward_out_norm)


def run_decoder_layer(spec: DecoderLayerSpec, positions: torch.Tensor, x: torch.Tensor,
                      residual: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, residual) of the layer. The residual stream travels as output + residual (x alone into the first
    layer), so that each pre-norm adds the previous block's output as it normalises, and the final norm the last's."""
    if residual is None:
        residual, x = x, spec.input_norm(x)
    else:
        x, residual = spec.input_norm(x, residual)
    x = finish_block(spec, run_attention(spec, positions, x, meta), spec.attention_out_norm)
    x, residual = spec.feed_forward_norm(x, residual)
    return run_feed_forward(spec, x), residual


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: a subclass builds its modules under the checkpoint's names and sets `spec`, the
    declaration of the part each plays, which `forward` interprets (and the CPU decode backend reads)."""

    spec: DecoderLayerSpec

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return run_decoder_layer(self.spec, positions, x, residual, meta)

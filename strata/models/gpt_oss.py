"""gpt-oss (20B, 120B), full-precision checkpoints: Llama's pre-norm decoder with q/k/v/o biases, a learned "sink"
logit per head that joins every softmax row and is dropped after it, sliding-window attention on alternating layers,
YaRN rotary, and on every layer routed experts with biases behind a biased router (top-k logits, softmax over those
k), gated by a clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(1.702 g) with g = min(gate, limit).

Checkpoints store experts fused, as x @ W: gate_up_proj [E, H, 2I] with gate and up interleaved column by column,
down_proj [E, I, H]; they are de-interleaved on the way in so that FusedMoE shards gate and up halves as usual.
MXFP4 checkpoints (quantization_config.quant_method mxfp4, as released) store each expert projection's transpose as
blocks [E, out, in/32, 16] and scales [E, out, in/32], gate and up in alternate rows; those stay 4-bit
(strata/layers/quantization/mxfp4.py).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strata.config import HFConfig
from strata.distributed import Collective, ParallelContext, StepSize, tp_collective
from strata.layers.attention import Attention
from strata.layers.decoder_layer import DecoderLayer, DecoderLayerSpec
from strata.layers.linear import ReplicatedLinear
from strata.layers.moe import FusedMoE, topk_then_softmax_routing
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding, rope_parameters
from strata.models.base import ModelArgs
from strata.models.dense_decoder import QKV_GATE_UP, DenseArgs, DenseAttention, DenseCausalLM

# transformers' GptOssConfig defaults, for config.json files that leave these keys out.
_DEFAULT_ROPE_THETA = 150000.0
_DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


@dataclass(frozen=True, kw_only=True)
class GptOssArgs(DenseArgs):
    num_experts: int
    experts_per_token: int
    swiglu_limit: float
    swiglu_alpha: float

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> GptOssArgs:
        bias = bool(cfg.get("attention_bias", True))
        attention = DenseArgs.attention(cfg)
        attention["rope_theta"], attention["rope_scaling"] = gpt_oss_rope(cfg)
        return cls(**ModelArgs.common(cfg, eps=1e-5), **attention, qkv_bias=bias, o_bias=bias,
                   windows=layer_windows(cfg), num_experts=cfg.get("num_local_experts", cfg.get("num_experts", 128)),
                   experts_per_token=cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)),
                   swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))


def gpt_oss_rope(cfg: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling): the config's own, or transformers' defaults for gpt-oss (base 150k, YaRN x32 over 4096)
    where config.json leaves them out."""
    values = cfg.to_dict()
    if not values.get("rope_parameters") and not values.get("rope_scaling"):
        values["rope_parameters"] = dict(_DEFAULT_YARN)
    params = values.get("rope_parameters") or {}
    if "rope_theta" not in params and "rope_theta" not in values:
        values["rope_theta"] = _DEFAULT_ROPE_THETA
    return rope_parameters(HFConfig(values))


def layer_windows(cfg: HFConfig) -> tuple[int | None, ...]:
    """The window of each layer `layer_types` marks sliding; without that list, layers 0, 2, 4... slide."""
    window = cfg.get("sliding_window", 128)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(cfg.num_hidden_layers)]
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[n, 2I] (gate columns, then up columns) -> (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate,
    limit): the clamps bound what a single outlier token can push through an expert."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssAttention(DenseAttention):
    """DenseAttention with one learned sink logit per head (this rank's heads), float32 as the softmax reads it."""

    def __init__(self, a: GptOssArgs, window: int | None, pc: ParallelContext, dtype: torch.dtype,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(a, window, pc, dtype, rotary)
        self.pc, heads = pc, self.qkv_proj.num_heads
        self.sinks = nn.Parameter(torch.zeros(heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self.load_sinks
        scale = a.head_dim ** -0.5 if a.attention_scale is None else a.attention_scale
        # Rebuilt with the sinks: the attention reads this very tensor, which loading fills in place.
        self.attn = Attention(heads, self.qkv_proj.num_kv_heads, a.head_dim, scale, sliding_window=window,
                              sinks=self.sinks)

    def load_sinks(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """The checkpoint's [num_heads] sinks, narrowed to the heads of this TP rank (contiguous, as q's rows)."""
        heads = param.shape[0]
        if loaded.shape != (heads * self.pc.tp_size,):
            raise ValueError(f"expected ({heads * self.pc.tp_size},), checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.pc.tp_rank * heads, heads))


class GptOssMoE(nn.Module):
    """The biased router and the routed experts; each expert's output is scaled by its weight, reduced once."""

    def __init__(self, a: GptOssArgs, pc: ParallelContext, dtype: torch.dtype, quantization: str | None) -> None:
        super().__init__()
        self.pc, self.hidden_size, self.dtype = pc, a.hidden_size, dtype
        self.router = ReplicatedLinear(a.hidden_size, a.num_experts, bias=True, dtype=dtype)
        activation = functools.partial(clamped_swiglu, limit=a.swiglu_limit, alpha=a.swiglu_alpha)
        self.experts = FusedMoE(a.num_experts, a.experts_per_token, a.hidden_size, a.intermediate_size, pc, dtype,
                                quantization, apply_router_weight_on_input=False, routing=topk_then_softmax_routing,
                                activation=activation, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pc.all_reduce(self.experts(x, self.router(x)))

    def collectives(self, step: StepSize) -> list[Collective]:
        return tp_collective(self.pc, "all_reduce", step.num_tokens * self.hidden_size, self.dtype)


class GptOssDecoderLayer(DecoderLayer):
    """Attention with sinks, then the routed experts as the feed-forward block: on the CPU decode path the attention
    block (sinks included) is one C call and the experts run as modules."""

    def __init__(self, a: GptOssArgs, index: int, pc: ParallelContext, dtype: torch.dtype, rotary: RotaryEmbedding,
                 quantization: str | None) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(a, a.window(index), pc, dtype, rotary)
        self.mlp = GptOssMoE(a, pc, dtype, quantization)
        self.input_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.spec = DecoderLayerSpec(**self.self_attn.parts(), input_norm=self.input_layernorm,
                                     feed_forward_norm=self.post_attention_layernorm, feed_forward=self.mlp)


class GptOssForCausalLM(DenseCausalLM):
    args: GptOssArgs
    args_class = GptOssArgs
    stacked_params = QKV_GATE_UP

    def make_layer(self, index: int) -> GptOssDecoderLayer:
        return GptOssDecoderLayer(self.args, index, self.pc, self.dtype, self.shared_rotary(), self.quantization)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_deinterleaved_experts(weights))


def _deinterleaved_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """gate_up_proj [E, H, 2I] and its bias [E, 2I] hold gate and up in alternate columns (gate even, up odd), MXFP4
    blocks [E, 2I, H/32, 16] and scales [E, 2I, H/32] in alternate rows; FusedMoE reads the gate half then the up
    half."""
    for name, tensor in weights:
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
            tensor = torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)
        elif name.endswith((".experts.gate_up_proj_blocks", ".experts.gate_up_proj_scales")):
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        yield name, tensor

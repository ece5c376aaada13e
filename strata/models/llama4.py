"""Llama 4 text model (Scout, Maverick): iRoPE attention (chunked local RoPE layers, global NoPE layers with
temperature tuning) and MoE feed-forward layers with a shared expert, interleaved with dense ones."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import Collective, ParallelContext, StepSize, tp_collective
from strata.layers.activation import silu_and_mul
from strata.layers.attention import Attention, AttentionMetadata
from strata.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from strata.layers.moe import FusedMoE, expert_params_mapping
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding, rope_parameters
from strata.models.base import CausalLM, ModelArgs
from strata.models.dense_decoder import QKV_GATE_UP
from strata.models.llama import LlamaArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerKind:
    """What differs between Llama 4 decoder layers; always derived from the global layer index."""

    use_rope: bool  # RoPE layers are local (chunked); NoPE layers are global
    chunk_size: int | None
    qk_norm: bool
    temperature_tuning: bool
    moe: bool


def moe_layer_indices(cfg: HFConfig) -> set[int]:
    """`moe_layers` when given, else every `interleave_moe_layer_step`-th layer (step 0: none)."""
    explicit = cfg.get("moe_layers")
    if explicit is not None:
        return set(explicit)
    step = cfg.get("interleave_moe_layer_step", 1)
    return {i for i in range(cfg.num_hidden_layers) if step > 0 and (i + 1) % step == 0}


def layer_kind(cfg: HFConfig, index: int) -> LayerKind:
    # `no_rope_layers[i] == 1` means layer i USES RoPE (the name is inverted); an empty list counts as unset.
    flags = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0)
                                          for i in range(cfg.num_hidden_layers)]
    use_rope = bool(flags[index])
    chunk = cfg.get("attention_chunk_size", 8192)
    return LayerKind(
        use_rope=use_rope,
        chunk_size=chunk if use_rope else None,
        qk_norm=bool(cfg.get("use_qk_norm", True)) and use_rope,
        # Old configs spell the flag as an int (4); any truthy value turns it on.
        temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)) and not use_rope,
        moe=index in moe_layer_indices(cfg),
    )


@dataclass(frozen=True, kw_only=True)
class Llama4Args(LlamaArgs):
    intermediate_size_mlp: int  # of the dense layers; `intermediate_size` is each expert's
    num_experts: int
    experts_per_token: int
    floor_scale: float
    attn_scale: float
    layer_kinds: tuple[LayerKind, ...]

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Llama4Args:
        heads = cfg.num_attention_heads
        theta, scaling = rope_parameters(cfg)
        return cls(**ModelArgs.common(cfg, eps=1e-5), intermediate_size=cfg.intermediate_size, num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg.hidden_size // heads, rope_theta=theta, rope_scaling=scaling,
                   attention_bias=cfg.get("attention_bias", False),
                   intermediate_size_mlp=cfg.get("intermediate_size_mlp", 16384),
                   num_experts=cfg.get("num_local_experts", 0), experts_per_token=cfg.get("num_experts_per_tok", 1),
                   floor_scale=cfg.get("floor_scale", 8192), attn_scale=cfg.get("attn_scale", 0.1),
                   layer_kinds=tuple(layer_kind(cfg, i) for i in range(cfg.num_hidden_layers)))


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4MLP(nn.Module):
    """SwiGLU MLP; with `reduce=False` its row-parallel output stays a partial sum for the caller to reduce."""

    def __init__(self, hidden: int, intermediate: int, pc: ParallelContext, dtype: torch.dtype,
                 reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, pc, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, pc, reduce_results=reduce, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Llama4MoE(nn.Module):
    """Routed experts (score scales each expert's input) plus an always-on shared expert, reduced once."""

    def __init__(self, a: Llama4Args, pc: ParallelContext, dtype: torch.dtype, quantization: str | None) -> None:
        super().__init__()
        self.pc, self.hidden_size, self.dtype = pc, a.hidden_size, dtype
        self.router = ReplicatedLinear(a.hidden_size, a.num_experts, dtype=dtype)
        self.experts = FusedMoE(a.num_experts, a.experts_per_token, a.hidden_size, a.intermediate_size,
                                pc, dtype, quantization, apply_router_weight_on_input=True)
        self.shared_expert = Llama4MLP(a.hidden_size, a.intermediate_size, pc, dtype, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(x)
        out += self.experts(x, self.router(x))
        return self.pc.all_reduce(out)

    def collectives(self, step: StepSize) -> list[Collective]:
        """Its parts leave partial sums (the shared expert does not reduce): one all-reduce in all."""
        return tp_collective(self.pc, "all_reduce", step.num_tokens * self.hidden_size, self.dtype)


class Llama4Attention(nn.Module):
    def __init__(self, a: Llama4Args, kind: LayerKind, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim, self.kind, self.eps = a.head_dim, kind, a.norm_eps
        self.floor_scale, self.attn_scale, bias = a.floor_scale, a.attn_scale, a.attention_bias
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, pc, bias, dtype)
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, pc, bias, dtype=dtype)
        self.rotary = None
        if kind.use_rope:
            self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling, interleaved=True)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, a.head_dim,
                              a.head_dim ** -0.5, chunk_size=kind.chunk_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(x))
        t = x.shape[0]
        q, k, v = q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim), v.view(t, -1, self.head_dim)
        if self.rotary is not None:
            # Pairs rotate as complex numbers in float32, as the reference does, then cast back.
            q32, k32 = self.rotary(positions, q.float(), k.float())
            q, k = q32.to(q.dtype), k32.to(k.dtype)
        if self.kind.qk_norm:
            q, k = weightless_rms_norm(q, self.eps), weightless_rms_norm(k, self.eps)
        if self.kind.temperature_tuning:
            # Global layers sharpen attention at long range: tau = 1 + s * ln(1 + floor((p + 1) / floor_scale)).
            tau = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * tau.view(t, 1, 1)).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, meta))


class Llama4DecoderLayer(nn.Module):
    """Pre-norm attention then a feed-forward block (MoE or MLP). Its own forward rather than a DecoderLayerSpec:
    its attention is not the declared kind (NoPE layers without rotary, pairs rotated as complex numbers in float32,
    weightless q/k norms after the rotation, a position-dependent temperature on global layers)."""

    def __init__(self, a: Llama4Args, index: int, pc: ParallelContext, dtype: torch.dtype,
                 quantization: str | None) -> None:
        super().__init__()
        kind = a.layer_kinds[index]
        self.self_attn = Llama4Attention(a, kind, pc, dtype)
        if kind.moe:
            self.feed_forward = Llama4MoE(a, pc, dtype, quantization)
        else:
            self.feed_forward = Llama4MLP(a.hidden_size, a.intermediate_size_mlp, pc, dtype)
        self.input_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward(x), residual


class Llama4ForCausalLM(CausalLM):
    args: Llama4Args
    args_class = Llama4Args
    ignored_weights = ("rotary_emb.inv_freq",)
    stacked_params = QKV_GATE_UP  # what the dense layers fuse; loading adds the experts' mapping

    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None, checkpoint_prefix: str = "") -> None:
        super().__init__(config, pc, layer_partition, checkpoint_prefix)
        # Experts may be stored fused [E, H, 2I] or one tensor per expert (quantized: several per expert).
        suffixes = {s: None for m in self.expert_layers() for s in m.checkpoint_suffixes} or {"weight": None}
        self.stacked_params = expert_params_mapping(self.args.num_experts, suffixes=tuple(suffixes)) + QKV_GATE_UP

    def make_layer(self, index: int) -> Llama4DecoderLayer:
        return Llama4DecoderLayer(self.args, index, self.pc, self.dtype, self.quantization)

    def expert_layers(self) -> list[FusedMoE]:
        """This stage's routed-expert layers (placeholder layers have none)."""
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        self._log_expert_memory()

    def _log_expert_memory(self) -> None:
        layers = self.expert_layers()
        if not layers:
            return
        held = sum(m.expert_bytes for m in layers)
        bf16 = sum(3 * m.num_experts * m.local_intermediate * m.hidden_size * 2 for m in layers)
        quant = layers[0].quant
        if quant is not None:
            kind = getattr(quant, "description", None) or f"{quant.scheme.format} {quant.scheme.bits}-bit"
        else:
            kind = "experts_int8" if layers[0].quantized else str(layers[0].gate_up_proj.dtype).replace("torch.", "")
        logger.info("%s routed experts (%s): %.2f MiB on this rank, %.3fx of bfloat16 (%.2f MiB)",
                    self.pc.log_prefix, kind, held / 2**20, held / bf16, bf16 / 2**20)

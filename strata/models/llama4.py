"""Llama 4 text model (Scout, Maverick): iRoPE attention (chunked local RoPE layers, global NoPE layers with
temperature tuning) and MoE feed-forward layers with a shared expert, interleaved with dense ones."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import Collective, ParallelContext, StepSize, pp_layer_range, tp_collective
from strata.layers.activation import silu_and_mul
from strata.layers.attention import Attention, AttentionMetadata
from strata.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from strata.layers.moe import FusedMoE, expert_params_mapping
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding, rope_parameters
from strata.models import loader
from strata.models.llama import LlamaModel, PreNormDecoderLayer
from strata.models.pipeline import on_stage, stage_embedding, stage_layers, stage_lm_head

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

    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype, quantization: str | None) -> None:
        super().__init__()
        self.pc, self.hidden_size, self.dtype = pc, cfg.hidden_size, dtype
        num_experts, hidden = cfg.num_local_experts, cfg.hidden_size
        self.router = ReplicatedLinear(hidden, num_experts, dtype=dtype)
        self.experts = FusedMoE(num_experts, cfg.get("num_experts_per_tok", 1), hidden, cfg.intermediate_size,
                                pc, dtype, quantization, apply_router_weight_on_input=True)
        self.shared_expert = Llama4MLP(hidden, cfg.intermediate_size, pc, dtype, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(x)
        out += self.experts(x, self.router(x))
        return self.pc.all_reduce(out)

    def collectives(self, step: StepSize) -> list[Collective]:
        """Its parts leave partial sums (the shared expert does not reduce): one all-reduce in all."""
        return tp_collective(self.pc, "all_reduce", step.num_tokens * self.hidden_size, self.dtype)


class Llama4Attention(nn.Module):
    def __init__(self, cfg: HFConfig, kind: LayerKind, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        num_heads = cfg.num_attention_heads
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or cfg.hidden_size // num_heads
        self.kind, self.eps = kind, cfg.get("rms_norm_eps", 1e-5)
        self.floor_scale, self.attn_scale = cfg.get("floor_scale", 8192), cfg.get("attn_scale", 0.1)
        bias = cfg.get("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, num_heads, num_kv_heads, pc, bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, cfg.hidden_size, pc, bias, dtype=dtype)
        self.rotary = None
        if kind.use_rope:
            base, scaling = rope_parameters(cfg)
            self.rotary = RotaryEmbedding(self.head_dim, base, scaling, interleaved=True)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, chunk_size=kind.chunk_size)

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


class Llama4DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: HFConfig, index: int, pc: ParallelContext, dtype: torch.dtype,
                 quantization: str | None) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-5)
        kind = layer_kind(cfg, index)
        self.self_attn = Llama4Attention(cfg, kind, pc, dtype)
        if kind.moe:
            self.feed_forward = Llama4MoE(cfg, pc, dtype, quantization)
        else:
            self.feed_forward = Llama4MLP(cfg.hidden_size, cfg.get("intermediate_size_mlp", 16384), pc, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)

    def feed_forward_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(x)


class Llama4TextModel(nn.Module):
    """Embedding, this stage's decoder layers (others are placeholders) and the final norm."""

    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype, quantization: str | None,
                 layer_partition: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.pc = pc
        self.start, self.end = pp_layer_range(cfg.num_hidden_layers, pc.pp_rank, pc.pp_size, layer_partition)
        self.missing_prefixes: list[str] = []
        missing = self.missing_prefixes
        tied = bool(cfg.get("tie_word_embeddings", False))
        self.embed_tokens = stage_embedding(cfg, pc, dtype, "model.embed_tokens", missing, tied)
        self.layers = stage_layers(cfg.num_hidden_layers, self.start, self.end,
                                   lambda i: Llama4DecoderLayer(cfg, i, pc, dtype, quantization), "model.layers",
                                   missing)
        self.norm = on_stage(pc.is_last_stage, lambda: RMSNorm(cfg.hidden_size, cfg.get("rms_norm_eps", 1e-5), dtype),
                             "model.norm", missing)

    # A pre-norm decoder stage runs exactly as Llama's does.
    forward = LlamaModel.forward


class Llama4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None) -> None:
        super().__init__()
        cfg, dtype = config.text_config, config.dtype
        self.pc, self.tied = pc, bool(cfg.get("tie_word_embeddings", False))
        self.num_experts = cfg.get("num_local_experts", 0)
        self.model = Llama4TextModel(cfg, pc, dtype, config.quantization, layer_partition)
        self.missing_prefixes = list(self.model.missing_prefixes)
        self.lm_head = stage_lm_head(cfg, pc, dtype, self.model.embed_tokens, self.missing_prefixes, self.tied)
        self.stacked_params: loader.StackedMapping = expert_params_mapping(self.num_experts) + [
            (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
            (".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1),
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, intermediate=None,
                inputs_embeds: torch.Tensor | None = None):
        return self.model(input_ids, positions, meta.attn, intermediate, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def expert_layers(self) -> list[FusedMoE]:
        """This stage's routed-expert layers (placeholder layers have none)."""
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads `model.*` / `lm_head.*` tensors; experts may be fused [E, H, 2I] or one tensor per expert."""
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
                return None
            return name

        loader.load_weights(self, weights, self.stacked_params, rename, self.missing_prefixes)
        self._log_expert_memory()

    def _log_expert_memory(self) -> None:
        layers = self.expert_layers()
        if not layers:
            return
        held = sum(m.expert_bytes for m in layers)
        bf16 = sum(3 * m.num_experts * m.local_intermediate * m.hidden_size * 2 for m in layers)
        kind = "experts_int8" if layers[0].quantized else str(layers[0].gate_up_proj.dtype).replace("torch.", "")
        logger.info("%s routed experts (%s): %.2f MiB on this rank, %.3fx of bfloat16 (%.2f MiB)",
                    self.pc.log_prefix, kind, held / 2**20, held / bf16, bf16 / 2**20)

"""Llama (1, 2, 3.x): pre-norm decoder layers of GQA attention with RoPE and a SwiGLU MLP."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import ParallelContext, pp_layer_range
from strata.layers.activation import silu_and_mul
from strata.layers.attention import Attention, AttentionMetadata
from strata.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding, rope_parameters
from strata.models import loader
from strata.models.pipeline import on_stage, stage_embedding, stage_layers, stage_lm_head


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, pc: ParallelContext, dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, pc, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, pc, bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        num_heads = cfg.num_attention_heads
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or cfg.hidden_size // num_heads
        bias = cfg.get("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, num_heads, num_kv_heads, pc, bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, cfg.hidden_size, pc, bias, dtype=dtype)
        base, scaling = rope_parameters(cfg)
        self.rotary = RotaryEmbedding(self.head_dim, base, scaling)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(x))
        t = x.shape[0]
        q, k = self.rotary(positions, q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim))
        out = self.attn(q, k, v.view(t, -1, self.head_dim), meta)
        return self.o_proj(out)


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
    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, pc, dtype)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, pc, dtype, cfg.get("mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)

    def feed_forward_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype,
                 layer_partition: tuple[int, ...] | None = None, prefix: str = "model") -> None:
        super().__init__()
        self.pc = pc
        tied = bool(cfg.get("tie_word_embeddings", False))
        self.start, self.end = pp_layer_range(cfg.num_hidden_layers, pc.pp_rank, pc.pp_size, layer_partition)
        self.missing_prefixes: list[str] = []
        missing = self.missing_prefixes
        self.embed_tokens = stage_embedding(cfg, pc, dtype, f"{prefix}.embed_tokens", missing, tied)
        self.layers = stage_layers(cfg.num_hidden_layers, self.start, self.end,
                                   lambda i: LlamaDecoderLayer(cfg, pc, dtype), f"{prefix}.layers", missing)
        self.norm = on_stage(pc.is_last_stage, lambda: RMSNorm(cfg.hidden_size, cfg.get("rms_norm_eps", 1e-6), dtype),
                             f"{prefix}.norm", missing)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: dict[str, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.pc.is_first_stage:
            x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
            residual = None
        else:
            x, residual = intermediate["hidden_states"], intermediate["residual"]
        for layer in self.layers[self.start:self.end]:
            x, residual = layer(positions, x, residual, meta)
        if not self.pc.is_last_stage:
            return {"hidden_states": x, "residual": residual}
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    stacked_params: loader.StackedMapping = [
        (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1),
    ]

    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None) -> None:
        super().__init__()
        cfg, dtype = config.text_config, config.dtype
        self.pc, self.tied = pc, bool(cfg.get("tie_word_embeddings", False))
        self.model = LlamaModel(cfg, pc, dtype, layer_partition)
        self.missing_prefixes = list(self.model.missing_prefixes)
        self.lm_head = stage_lm_head(cfg, pc, dtype, self.model.embed_tokens, self.missing_prefixes, self.tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, intermediate=None,
                inputs_embeds: torch.Tensor | None = None):
        return self.model(input_ids, positions, meta.attn, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
                return None
            return name

        loader.load_weights(self, weights, self.stacked_params, rename, self.missing_prefixes)

"""Mamba2 (transformers' `Mamba2ForCausalLM` layout): an embedding, pre-norm residual blocks of one Mamba2
mixer each (no attention, no MLP), a final RMSNorm and an LM head."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.errors import UnsupportedModelError
from strata.distributed import ParallelContext, pp_layer_range
from strata.layers.linear import RowParallelLinear
from strata.layers.mamba.mixer import (
    ConvWeights,
    GatedRMSNorm,
    MambaBatch,
    MambaState,
    ShardedColumnLinear,
    sharded_param,
    units_per_rank,
)
from strata.layers.norm import RMSNorm
from strata.models import loader
from strata.models.pipeline import on_stage, stage_embedding, stage_layers, stage_lm_head


def _a_from_a_log(a_log: torch.Tensor) -> torch.Tensor:
    return -torch.exp(a_log.float())


def _config_float(value: float | str | dict) -> float:
    """transformers 5 writes non-finite floats into config.json as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | x B C | dt]; x B C through the causal conv; SSM over x; gated RMSNorm with z; out_proj."""

    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads, head_dim = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        inner = int(cfg.get("expand", 2) * d)
        groups, n, width = cfg.get("n_groups", 1), cfg.state_size, cfg.get("conv_kernel", 4)
        if heads * head_dim != inner:
            raise UnsupportedModelError(f"Mamba2 needs num_heads * head_dim ({heads} * {head_dim}) == expand * "
                                        f"hidden_size ({inner})", param="num_heads")
        if cfg.get("use_bias", False):
            raise UnsupportedModelError("Mamba2 checkpoints with use_bias=true are not supported", param="use_bias")
        tp = pc.tp_size
        self.heads, self.head_dim, self.state_size = heads // tp, head_dim, n
        self.inner, self.groups = inner // tp, units_per_rank(groups, tp)
        group_width = self.groups * n
        xbc = [(inner, heads), (groups * n, groups), (groups * n, groups)]
        self.in_proj = ShardedColumnLinear(d, [(inner, heads), *xbc, (heads, heads)], pc, dtype)
        self.conv1d = ConvWeights(xbc, width, cfg.get("use_conv_bias", True), pc, dtype)
        self.A = sharded_param([(heads, heads)], (), pc, torch.float32, transform=_a_from_a_log)
        self.D = sharded_param([(heads, heads)], (), pc, torch.float32)
        self.dt_bias = sharded_param([(heads, heads)], (), pc, torch.float32)
        self.norm = GatedRMSNorm(inner, groups, heads, cfg.get("layer_norm_epsilon", 1e-5), pc, dtype)
        self.out_proj = RowParallelLinear(inner, d, pc, dtype=dtype)
        limit = tuple(_config_float(v) for v in cfg.get("time_step_limit") or (0.0, math.inf))
        self.state = MambaState(self.inner + 2 * group_width, width, self.heads, head_dim, n, limit)

    def forward(self, h: torch.Tensor, batch: MambaBatch) -> torch.Tensor:
        t, group_width = h.shape[0], self.groups * self.state_size
        z, xbc, dt = self.in_proj(h).split([self.inner, self.inner + 2 * group_width, self.heads], dim=-1)
        xbc = self.state.conv(xbc, self.conv1d.weight, self.conv1d.bias, batch)
        x, b, c = xbc.split([self.inner, group_width, group_width], dim=-1)
        y = self.state.scan(x.view(t, self.heads, self.head_dim), dt, self.A,
                            b.view(t, self.groups, self.state_size), c.view(t, self.groups, self.state_size),
                            self.D, None, self.dt_bias, batch)
        return self.out_proj(self.norm(y.view(t, self.inner), z))


class Mamba2Block(nn.Module):
    """residual += mixer(norm(residual)); the residual stream may be kept in float32 (`residual_in_fp32`)."""

    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(cfg.get("residual_in_fp32", True))
        self.norm = RMSNorm(cfg.hidden_size, cfg.get("layer_norm_epsilon", 1e-5), dtype)
        self.mixer = Mamba2Mixer(cfg, pc, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: MambaBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        if self.residual_in_fp32:
            residual = residual.float()
        return self.mixer(self.norm(residual.to(x.dtype)), batch), residual


class Mamba2Model(nn.Module):
    def __init__(self, cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype,
                 layer_partition: tuple[int, ...] | None = None, prefix: str = "backbone") -> None:
        super().__init__()
        self.pc, self.dtype = pc, dtype
        tied = bool(cfg.get("tie_word_embeddings", False))
        self.start, self.end = pp_layer_range(cfg.num_hidden_layers, pc.pp_rank, pc.pp_size, layer_partition)
        self.missing_prefixes: list[str] = []
        missing = self.missing_prefixes
        self.embeddings = stage_embedding(cfg, pc, dtype, f"{prefix}.embeddings", missing, tied)
        self.layers = stage_layers(cfg.num_hidden_layers, self.start, self.end,
                                   lambda i: Mamba2Block(cfg, pc, dtype), f"{prefix}.layers", missing)
        self.norm_f = on_stage(pc.is_last_stage,
                               lambda: RMSNorm(cfg.hidden_size, cfg.get("layer_norm_epsilon", 1e-5), dtype),
                               f"{prefix}.norm_f", missing)

    def forward(self, input_ids: torch.Tensor, meta, intermediate: dict[str, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        batch = MambaBatch.from_meta(meta)
        if self.pc.is_first_stage:
            x = inputs_embeds if inputs_embeds is not None else self.embeddings(input_ids)
            residual = None
        else:
            x, residual = intermediate["hidden_states"], intermediate["residual"]
        for layer in self.layers[self.start:self.end]:
            x, residual = layer(x, residual, batch)
        if not self.pc.is_last_stage:
            return {"hidden_states": x, "residual": residual.to(x.dtype)}
        return self.norm_f((residual + x).to(self.dtype))


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None) -> None:
        super().__init__()
        cfg, dtype = config.text_config, config.dtype
        self.pc, self.tied = pc, bool(cfg.get("tie_word_embeddings", False))
        self.backbone = Mamba2Model(cfg, pc, dtype, layer_partition)
        self.missing_prefixes = list(self.backbone.missing_prefixes)
        self.lm_head = stage_lm_head(cfg, pc, dtype, self.backbone.embeddings, self.missing_prefixes, self.tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, intermediate=None,
                inputs_embeds: torch.Tensor | None = None):
        return self.backbone(input_ids, meta, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if self.tied and name == "lm_head.weight":
                return None
            # Original state-spaces checkpoints say `embedding`; transformers renames it the same way.
            name = name.replace("backbone.embedding.", "backbone.embeddings.")
            return name.replace(".A_log", ".A")

        loader.load_weights(self, weights, (), rename, self.missing_prefixes)

"""Mamba2 (transformers' `Mamba2ForCausalLM` layout): an embedding, pre-norm residual blocks of one Mamba2
mixer each (no attention, no MLP), a final RMSNorm and an LM head."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from strata.config import HFConfig
from strata.distributed import ParallelContext
from strata.errors import UnsupportedModelError
from strata.layers.forward_meta import ForwardMeta
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
from strata.models.base import CausalLM, CheckpointNames, ModelArgs


def _a_from_a_log(a_log: torch.Tensor) -> torch.Tensor:
    return -torch.exp(a_log.float())


def _config_float(value: float | str | dict) -> float:
    """transformers 5 writes non-finite floats into config.json as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


@dataclass(frozen=True, kw_only=True)
class Mamba2Args(ModelArgs):
    num_heads: int
    head_dim: int
    inner_size: int  # expand * hidden_size == num_heads * head_dim
    n_groups: int
    state_size: int
    conv_kernel: int
    use_conv_bias: bool
    time_step_limit: tuple[float, float]
    residual_in_fp32: bool

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Mamba2Args:
        heads, head_dim, inner = cfg.num_heads, cfg.head_dim, int(cfg.get("expand", 2) * cfg.hidden_size)
        if heads * head_dim != inner:
            raise UnsupportedModelError(f"Mamba2 needs num_heads * head_dim ({heads} * {head_dim}) == expand * "
                                        f"hidden_size ({inner})", param="num_heads")
        if cfg.get("use_bias", False):
            raise UnsupportedModelError("Mamba2 checkpoints with use_bias=true are not supported", param="use_bias")
        low, high = (_config_float(v) for v in cfg.get("time_step_limit") or (0.0, math.inf))
        return cls(**ModelArgs.common(cfg, eps_key="layer_norm_epsilon", eps=1e-5), num_heads=heads,
                   head_dim=head_dim, inner_size=inner, n_groups=cfg.get("n_groups", 1), state_size=cfg.state_size,
                   conv_kernel=cfg.get("conv_kernel", 4), use_conv_bias=cfg.get("use_conv_bias", True),
                   time_step_limit=(low, high), residual_in_fp32=bool(cfg.get("residual_in_fp32", True)))


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | x B C | dt]; x B C through the causal conv; SSM over x; gated RMSNorm with z; out_proj."""

    def __init__(self, a: Mamba2Args, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads, head_dim, inner = a.hidden_size, a.num_heads, a.head_dim, a.inner_size
        groups, n, width = a.n_groups, a.state_size, a.conv_kernel
        tp = pc.tp_size
        self.heads, self.head_dim, self.state_size = heads // tp, head_dim, n
        self.inner, self.groups = inner // tp, units_per_rank(groups, tp)
        group_width = self.groups * n
        xbc = [(inner, heads), (groups * n, groups), (groups * n, groups)]
        self.in_proj = ShardedColumnLinear(d, [(inner, heads), *xbc, (heads, heads)], pc, dtype)
        self.conv1d = ConvWeights(xbc, width, a.use_conv_bias, pc, dtype)
        self.A = sharded_param([(heads, heads)], (), pc, torch.float32, transform=_a_from_a_log)
        self.D = sharded_param([(heads, heads)], (), pc, torch.float32)
        self.dt_bias = sharded_param([(heads, heads)], (), pc, torch.float32)
        self.norm = GatedRMSNorm(inner, groups, heads, a.norm_eps, pc, dtype)
        self.out_proj = RowParallelLinear(inner, d, pc, dtype=dtype)
        self.state = MambaState(self.inner + 2 * group_width, width, self.heads, head_dim, n, a.time_step_limit)

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

    def __init__(self, a: Mamba2Args, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.residual_in_fp32 = a.residual_in_fp32
        self.norm = RMSNorm(a.hidden_size, a.norm_eps, dtype)
        self.mixer = Mamba2Mixer(a, pc, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, batch: MambaBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        if self.residual_in_fp32:
            residual = residual.float()
        return self.mixer(self.norm(residual.to(x.dtype)), batch), residual


class Mamba2ForCausalLM(CausalLM):
    args: Mamba2Args
    args_class = Mamba2Args
    names = CheckpointNames(embedding="backbone.embeddings", layers="backbone.layers", norm="backbone.norm_f")

    def make_layer(self, index: int) -> Mamba2Block:
        return Mamba2Block(self.args, self.pc, self.dtype)

    def layer_context(self, meta: ForwardMeta) -> MambaBatch:
        return meta.mamba

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f((residual + x).to(self.dtype))

    def rename_weight(self, name: str) -> str:
        # Original state-spaces checkpoints say `embedding`; transformers renames it the same way.
        name = name.replace("backbone.embedding.", "backbone.embeddings.")
        return name.replace(".A_log", ".A")

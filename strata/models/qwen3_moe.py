"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 attention; on sparse layers routed SwiGLU experts behind a bias-free router
(softmax in float32, top-k, renormalised with `norm_topk_prob`), no shared expert; dense layers keep an MLP."""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import Collective, ParallelContext, StepSize, tp_collective
from strata.layers.linear import ReplicatedLinear
from strata.layers.moe import FusedMoE, expert_params_mapping, topk_softmax_routing
from strata.models.base import ModelArgs
from strata.models.dense_decoder import QKV_GATE_UP, DenseArgs, DenseCausalLM, DenseDecoderLayer


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeArgs(DenseArgs):
    moe_intermediate_size: int
    num_experts: int
    experts_per_token: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Qwen3MoeArgs:
        bias = bool(cfg.get("attention_bias", False))
        # transformers saves `num_experts` as `num_local_experts` (its attribute map); releases spell it num_experts.
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        n = cfg.num_hidden_layers
        return cls(**ModelArgs.common(cfg), **DenseArgs.attention(cfg), qkv_bias=bias, o_bias=bias, qk_norm=True,
                   windows=(window,) * n, moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
                   num_experts=experts, experts_per_token=cfg.get("num_experts_per_tok", 8),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)))


class Qwen3MoeSparseBlock(nn.Module):
    """The router (`gate`) and the routed experts; each expert's output is scaled by its weight, reduced once."""

    def __init__(self, a: Qwen3MoeArgs, pc: ParallelContext, dtype: torch.dtype, quantization: str | None) -> None:
        super().__init__()
        self.pc, self.hidden_size, self.dtype = pc, a.hidden_size, dtype
        self.gate = ReplicatedLinear(a.hidden_size, a.num_experts, dtype=dtype)
        routing = functools.partial(topk_softmax_routing, renormalize=a.norm_topk_prob)
        self.experts = FusedMoE(a.num_experts, a.experts_per_token, a.hidden_size, a.moe_intermediate_size, pc,
                                dtype, quantization, apply_router_weight_on_input=False, routing=routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pc.all_reduce(self.experts(x, self.gate(x)))

    def collectives(self, step: StepSize) -> list[Collective]:
        return tp_collective(self.pc, "all_reduce", step.num_tokens * self.hidden_size, self.dtype)


class Qwen3MoeForCausalLM(DenseCausalLM):
    args: Qwen3MoeArgs
    args_class = Qwen3MoeArgs

    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None, checkpoint_prefix: str = "") -> None:
        super().__init__(config, pc, layer_partition, checkpoint_prefix)
        # Per-expert checkpoint tensors (quantized ones: several per expert) go first: the dense mapping's
        # ".gate_proj." would also match an expert's name.
        experts = [m for m in self.modules() if isinstance(m, FusedMoE)]
        suffixes = {s: None for m in experts for s in m.checkpoint_suffixes} or {"weight": None}
        self.stacked_params = expert_params_mapping(self.args.num_experts, suffixes=tuple(suffixes)) + QKV_GATE_UP

    def make_layer(self, index: int) -> DenseDecoderLayer:
        a = self.args
        mlp = Qwen3MoeSparseBlock(a, self.pc, self.dtype, self.quantization) if a.sparse_layers[index] else None
        return DenseDecoderLayer(a, index, self.pc, self.dtype, self.shared_rotary(), mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_experts_as_stored_by_llama4(weights))


def _experts_as_stored_by_llama4(weights: Iterable[tuple[str, torch.Tensor]]
                                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Experts fused into 3-D tensors as transformers 5 holds them in memory (gate_up_proj [E, 2I, H], down_proj
    [E, H, I], rows = outputs), turned into the x @ W layout FusedMoE reads fused tensors in ([E, H, 2I], [E, I, H]).
    Released checkpoints and transformers' save_pretrained store one tensor per expert instead, which pass as
    they are."""
    for name, tensor in weights:
        # The name first: a GGUF file's tensors in ggml blocks (GGUFTensor) have no dim().
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)
        yield name, tensor

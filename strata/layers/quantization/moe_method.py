"""Routed experts of a quantized checkpoint (Llama 4 Scout W4A16 style: one quantized gate/up/down per expert).

Each stored tensor kind (`weight_packed`, `weight_scale`, ... or GPTQ/AWQ's) becomes one stacked parameter
`[E, ...]` per projection, loaded and TP-sharded like the dense experts (gate/up rows, down columns); after
loading every expert holds two packed weights, its gate and up rows fused, and its down projection."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from strata.config.quant_config import AWQ, GPTQ, PACKED, LinearScheme
from strata.errors import ConfigError
from strata.kernels.cpu import cpu_kernels_apply, crossovers
from strata.kernels.cpu.crossovers import SMALL_BATCH_WEIGHT_ONLY
from strata.layers.activation import silu_and_mul
from strata.layers.moe import DOWN, GATE, FusedMoE
from strata.layers.quantization.formats import TensorLayout, layouts, to_canonical
from strata.layers.quantization.stored import load_stored, local_shape
from strata.layers.quantization.weight_only import (
    QuantizedWeight,
    kernel_operands,
    pack_weight,
    weight_only_linear,
)

WEIGHT_ONLY = (PACKED, GPTQ, AWQ)
GATE_UP, DOWN_PROJ = "gate_up_proj", "down_proj"


@dataclass(frozen=True)
class _ExpertPart:
    """Where one checkpoint tensor of an expert lands on this rank (the `ShardedLayer` of `load_stored`)."""

    in_start: int
    in_size: int
    out_offset: int
    out_start: int
    out_size: int

    def in_range(self) -> tuple[int, int]:
        return self.in_start, self.in_size

    def out_pieces(self, shard_id: object = None) -> list[tuple[int, int, int]]:
        return [(self.out_offset, self.out_start, self.out_size)]


def _is_g_idx(lay: TensorLayout) -> bool:
    return lay.out_dim is None and lay.in_dim is not None


class QuantizedExpertsMethod:
    """The packed weights of every expert of one `FusedMoE` and the products with them."""

    def __init__(self, scheme: LinearScheme) -> None:
        self.scheme = scheme
        self.gate_up: list[QuantizedWeight] = []
        self.down: list[QuantizedWeight] = []
        self.perms: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # activation order, per expert
        # gate_up's and down's: up to them the small-batch kernel
        self.small_rows = (SMALL_BATCH_WEIGHT_ONLY, SMALL_BATCH_WEIGHT_ONLY)

    def stored_names(self, moe: FusedMoE) -> dict[str, dict[str, TensorLayout]]:
        """Projection -> {suffix: layout} of the tensors each expert stores (layouts judge groups on full K)."""
        return {GATE_UP: layouts(self.scheme, moe.hidden_size), DOWN_PROJ: layouts(self.scheme, moe.intermediate_size)}

    def part(self, moe: FusedMoE, piece: object) -> _ExpertPart:
        i, h, start = moe.local_intermediate, moe.hidden_size, moe.pc.tp_rank * moe.local_intermediate
        if piece == DOWN:
            return _ExpertPart(start, i, 0, 0, h)
        return _ExpertPart(0, h, 0 if piece == GATE else i, start, i)

    def load(self, moe: FusedMoE, lay: TensorLayout, suffix: str, param: torch.Tensor, loaded: torch.Tensor,
             shard_id: object = None) -> None:
        if not isinstance(shard_id, tuple):
            raise ValueError("quantized experts are read one tensor per expert and projection")
        expert, piece = shard_id
        target = param.data[expert]
        if _is_g_idx(lay) and piece != DOWN:  # gate and up each keep their own, compared when finishing
            target = target[0 if piece == GATE else 1]
        load_stored(self.part(moe, piece), lay, suffix, target, loaded, piece)

    def finish(self, moe: FusedMoE) -> None:
        """Stacked stored tensors -> one packed weight per expert and projection; the stored ones are dropped."""
        if self.gate_up:
            return
        names = self.stored_names(moe)
        i, h = moe.local_intermediate, moe.hidden_size
        for e in range(moe.num_experts):
            gate_up, gate_up_perm = self._pack(moe, e, GATE_UP, names[GATE_UP], 2 * i, h)
            down, down_perm = self._pack(moe, e, DOWN_PROJ, names[DOWN_PROJ], h, i)
            self.gate_up.append(gate_up)
            self.down.append(down)
            self.perms.append((gate_up_perm, down_perm))
        for proj, suffixes in names.items():
            for suffix in suffixes:
                delattr(moe, f"{proj}_{suffix}")
        if self.gate_up and cpu_kernels_apply(self.gate_up[0].packed):  # measured (and cached) per kind and shape
            self.small_rows = tuple(crossovers.choose(kernel_operands(w[0]), w[0].in_features)
                                    for w in (self.gate_up, self.down))

    def _pack(self, moe: FusedMoE, e: int, proj: str, lays: dict[str, TensorLayout], n: int,
              k: int) -> tuple[QuantizedWeight, torch.Tensor | None]:
        stored = {}
        for suffix, lay in lays.items():
            t = getattr(moe, f"{proj}_{suffix}").data[e]
            if _is_g_idx(lay) and proj == GATE_UP:
                if not torch.equal(t[0], t[1]):
                    raise ConfigError(f"expert {e}: gate_proj.{suffix} and up_proj.{suffix} differ; strata runs "
                                      "them as one fused layer", param="model")
                t = t[0]
            stored[suffix] = t
        canonical = to_canonical(self.scheme, stored, n, k)
        groups = canonical.scales.shape[1]
        group_size = -1 if groups == 1 else k // groups
        return pack_weight(canonical.q, canonical.scales, canonical.zeros, self.scheme.bits, group_size), \
            canonical.perm

    def apply(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU on its tokens h [n, H] -> [n, H] (this rank's partial sum)."""
        gate_up_perm, down_perm = self.perms[expert]
        if gate_up_perm is not None:
            h = h[:, gate_up_perm]
        act = silu_and_mul(weight_only_linear(h, self.gate_up[expert], small_rows=self.small_rows[0]))
        if down_perm is not None:
            act = act[:, down_perm]
        return weight_only_linear(act, self.down[expert], small_rows=self.small_rows[1])

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.gate_up + self.down)


def quantize_experts(moe: FusedMoE, scheme: LinearScheme, name: str) -> None:
    """Replace the experts' dense tensors by the stacked stored tensors of `scheme`, each with its loader."""
    if scheme.format not in WEIGHT_ONLY:
        raise ConfigError(f"{name}: routed experts stored as {scheme.format} ({scheme.bits}-bit weights with "
                          "quantized activations) are not supported; strata runs quantized experts with "
                          f"weight-only schemes ({', '.join(WEIGHT_ONLY)}, e.g. W4A16 / W8A16)",
                          param="quantization")
    if scheme.act_order and moe.pc.tp_size > 1:
        raise ConfigError(f"{name}: activation-ordered groups (desc_act / actorder) of down_proj cannot be split "
                          f"across tensor_parallel_size={moe.pc.tp_size} ranks along its inputs; use "
                          "tensor_parallel_size=1 or a checkpoint without activation ordering",
                          param="tensor_parallel_size")
    if moe.quantized:
        raise ConfigError(f"{name}: quantization='experts_int8' cannot requantize experts the checkpoint stores "
                          "quantized", param="quantization")
    method = QuantizedExpertsMethod(scheme)
    device = moe.gate_up_proj.device
    del moe.gate_up_proj, moe.down_proj
    e, i, h = moe.num_experts, moe.local_intermediate, moe.hidden_size
    sizes = {GATE_UP: (2 * i, h), DOWN_PROJ: (h, i)}
    for proj, lays in method.stored_names(moe).items():
        for suffix, lay in lays.items():
            shape = local_shape(lay, *sizes[proj])
            if _is_g_idx(lay) and proj == GATE_UP:
                shape = (2, *shape)
            param = nn.Parameter(torch.empty((e, *shape), dtype=lay.dtype, device=device), requires_grad=False)
            param.weight_loader = functools.partial(method.load, moe, lay, suffix)
            moe.register_parameter(f"{proj}_{suffix}", param)
    moe.quant = method

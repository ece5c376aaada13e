"""Routed experts of a GGUF file kept in their ggml blocks (qwen3moe's and llama4's `ffn_{gate,up,down}_exps`, in any
type strata's dense GGUF layers read): each active expert runs its tokens through the GGUF kernels of `gguf_quants`,
gate and up as one product when they share a type, then down, as llama.cpp's mul_mat_id and vLLM's GGUF MoE do.
Routing, the routing weights and the activation stay FusedMoE's, as for its float experts. With int8 activations
each token's row is rounded once a step for all its experts' gate/up products (`round_inputs`)."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from strata.config.quant_config import GGUFQuantConfig
from strata.errors import ConfigError
from strata.gguf import types
from strata.gguf.weights import GGUFTensor
from strata.kernels.cpu import cpu_kernels_apply, crossovers
from strata.layers.moe import DOWN, GATE, UP, FusedMoE
from strata.layers.quantization import gguf_quants
from strata.layers.quantization.rounded_rows import RoundedRows

logger = logging.getLogger(__name__)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's checkpoint tensors
_PROJECTION = {GATE: "gate_proj", UP: "up_proj", DOWN: "down_proj"}  # FusedMoE's shard ids


@dataclass
class ExpertBlocks:
    """One product of every expert on this rank: `data` uint8 [E, rows, row_bytes] in `ggml_type`, `k` inputs a
    row; `small_rows` is measured at finish; `activations` "int8" rounds x as llama.cpp does."""

    data: torch.Tensor
    ggml_type: int
    k: int
    activations: str = "float"
    small_rows: int = crossovers.SMALL_BATCH_GGUF

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return gguf_quants.gguf_linear(x, self.data[expert], self.ggml_type, self.k, None, self.small_rows,
                                       self.activations)

    def rounded(self, expert: int, x: RoundedRows, tokens: torch.Tensor) -> torch.Tensor:
        """Rows `tokens` of x, rounded once for every expert, times this expert's weight."""
        per_block = gguf_quants.TYPES[self.ggml_type].values_per_block
        return x.product(tokens, self.data[expert], gguf_quants.kernel_kind(self.ggml_type, "int8"), per_block,
                         self.data.shape[1])


class GGUFExpertsMethod:
    """A FusedMoE's experts as this rank's ggml blocks: gate and up rows [I/tp] of each expert (one product
    [E, 2I/tp, ...] when both have one type), down's inputs cut to this rank's I/tp at whole blocks. Each expert's
    tensors arrive one by one (strata.gguf.weights.expert_blocks) and are copied into place."""

    def __init__(self, moe: FusedMoE, name: str, kinds: dict[str, int], device: torch.device,
                 activations: str = "float") -> None:
        self.name, self.kinds, self.activations = name, kinds, activations
        e, h, i = moe.num_experts, moe.hidden_size, moe.local_intermediate
        fused = kinds["gate_proj"] == kinds["up_proj"]
        # projection -> (its product, first row there)
        self.place = {"gate_proj": ("gate_up" if fused else "gate", 0),
                      "up_proj": ("gate_up", i) if fused else ("up", 0), "down_proj": ("down", 0)}
        shapes = {"gate_up": (kinds["gate_proj"], 2 * i, h)} if fused else {
            "gate": (kinds["gate_proj"], i, h), "up": (kinds["up_proj"], i, h)}
        shapes["down"] = (kinds["down_proj"], h, i)
        self.products = {key: ExpertBlocks(torch.empty(e, rows, types.row_bytes(kind, k, f"{name}.{key}"),
                                                       dtype=torch.uint8, device=device), kind, k, activations)
                         for key, (kind, rows, k) in shapes.items()}
        self.activation = None
        self.finished = False

    def stored_names(self, moe: FusedMoE) -> dict[str, dict[str, None]]:
        return {"gate_up_proj": {"weight": None}, "down_proj": {"weight": None}}

    def load(self, moe: FusedMoE, param: torch.Tensor, loaded: object, shard_id: object = None) -> None:
        """One expert's gate, up or down tensor in its blocks [out, row_bytes], cut to this rank's share."""
        if not isinstance(loaded, GGUFTensor) or shard_id is None:
            raise ValueError("expected one expert's tensor in ggml blocks")
        expert, part = shard_id
        proj = _PROJECTION[part]
        if loaded.ggml_type != self.kinds[proj]:
            raise ValueError(f"{proj} is {types.type_name(loaded.ggml_type)}, the file's table says "
                             f"{types.type_name(self.kinds[proj])}")
        h, full_i = moe.hidden_size, moe.intermediate_size
        expected = (h, full_i) if part == DOWN else (full_i, h)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected {proj} of shape {expected}, the file has {tuple(loaded.shape)}")
        rank, i = moe.pc.tp_rank, moe.local_intermediate
        data = loaded.data.reshape(expected[0], loaded.row_bytes)
        if part == DOWN:
            block = types.check_type(loaded.ggml_type, proj)
            start = rank * i
            if start % block.values_per_block or i % block.values_per_block:
                raise ValueError(f"inputs {start}..{start + i} of this rank cut a {block.name} block of "
                                 f"{block.values_per_block} values")
            first = start // block.values_per_block * block.bytes_per_block
            data = data[:, first:first + i // block.values_per_block * block.bytes_per_block]
        else:
            data = data[rank * i:(rank + 1) * i]
        key, row = self.place[proj]
        self.products[key].data[expert, row:row + data.shape[0]].copy_(data)

    def finish(self, moe: FusedMoE) -> None:
        if self.finished:
            return
        self.activation, self.finished = moe.activation, True
        for product in self.products.values():
            # measured once (and cached) per type and shape; int8 activations take one kernel at every size
            if self.activations == "float" and cpu_kernels_apply(product.data):
                operands = {"weight": product.data[0], "kind": gguf_quants.kernel_kind(product.ggml_type),
                            "out_features": product.data.shape[1]}
                product.small_rows = crossovers.choose(operands, product.k)

    def apply(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP on its tokens h [n, H] -> [n, H] (this rank's partial sum)."""
        if not self.finished:
            raise RuntimeError(f"{self.name}: GGUF experts ran before their weights were loaded and finished")
        p = self.products
        gate_up = p["gate_up"](expert, h) if "gate_up" in p else torch.cat([p["gate"](expert, h),
                                                                             p["up"](expert, h)], dim=-1)
        return p["down"](expert, self.activation(gate_up))

    def round_inputs(self, x: torch.Tensor) -> RoundedRows | None:
        """A step's rows x [T, H] for `apply_rounded` (rounded on first use), or None with float activations."""
        return RoundedRows(x) if self.activations == "int8" else None

    def apply_rounded(self, expert: int, x: RoundedRows, tokens: torch.Tensor) -> torch.Tensor:
        """`apply` on rows `tokens` of x, rounded once for all experts; down rounds its own input."""
        if not self.finished:
            raise RuntimeError(f"{self.name}: GGUF experts ran before their weights were loaded and finished")
        p = self.products
        gate_up = p["gate_up"].rounded(expert, x, tokens) if "gate_up" in p else torch.cat(
            [p["gate"].rounded(expert, x, tokens), p["up"].rounded(expert, x, tokens)], dim=-1)
        return p["down"](expert, self.activation(gate_up))

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.products.values())

    @property
    def description(self) -> str:
        return "GGUF " + "/".join(types.type_name(self.kinds[p]) for p in PROJECTIONS)


def gguf_experts(moe: FusedMoE, name: str, kinds: dict[str, int], activations: str = "float") -> None:
    """Replace a FusedMoE's float expert tensors by placeholders whose loaders hand each expert's ggml blocks to a
    GGUFExpertsMethod (`kinds`: the ggml type of gate_proj, up_proj and down_proj; `activations`: "int8" rounds x
    as llama.cpp does, refused for a type without those kernels)."""
    if moe.quantized:
        raise ConfigError(f"{name}: quantization='experts_int8' cannot requantize experts the GGUF file stores in "
                          "ggml blocks", param="quantization")
    if moe.gate_up_proj_bias is not None:
        raise ConfigError(f"{name}: strata runs GGUF experts in ggml blocks without biases", param="model")
    block = types.check_type(kinds["down_proj"], f"{name}.down_proj")
    if moe.local_intermediate % block.values_per_block:
        raise ConfigError(f"{name}: tensor_parallel_size={moe.pc.tp_size} leaves {moe.local_intermediate} of the "
                          f"experts' {moe.intermediate_size} down_proj inputs on each rank, which cuts a {block.name} "
                          f"block of {block.values_per_block} values", param="tensor_parallel_size")
    if activations == "int8":
        for proj in PROJECTIONS:
            gguf_quants.check_int8_type(kinds[proj], f"{name}.{proj}")
    device = moe.gate_up_proj.device
    method = GGUFExpertsMethod(moe, name, kinds, device, activations)
    del moe.gate_up_proj, moe.down_proj
    for proj in ("gate_up_proj", "down_proj"):
        # An empty placeholder: the loader finds the experts' tensors under its name; the blocks live in the method.
        param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device), requires_grad=False)
        param.weight_loader = functools.partial(method.load, moe)
        moe.register_parameter(proj, param)
    moe.quant = method


def quantize_gguf_experts(model: nn.Module, quant: GGUFQuantConfig, checkpoint_prefix: str) -> None:
    """Every FusedMoE whose experts the GGUF file keeps in blocks (qwen3moe, llama4) runs them from those blocks."""
    count = 0
    for name, moe in model.named_modules():
        if not isinstance(moe, FusedMoE):
            continue
        kinds = {p: quant.tensor_types.get(f"{checkpoint_prefix}{name}.{p}.weight") for p in PROJECTIONS}
        if any(k is None for k in kinds.values()):
            continue  # float experts (or gpt-oss's MXFP4 ones, named otherwise)
        gguf_experts(moe, name, kinds, quant.activations)
        count += 1
    if count:
        logger.info("GGUF checkpoint: %d routed-expert layers kept in ggml blocks", count)

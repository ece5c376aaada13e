"""Routed SwiGLU experts (top-k routing, TP-sharded along each expert's intermediate size, optional biases and
another gated activation) and their optional `experts_int8` weight-only quantization (int8 weights, one scale per
output channel)."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import ParallelContext
from strata.layers.activation import silu_and_mul
from strata.layers.linear import shard_dim

logger = logging.getLogger(__name__)

EXPERTS_INT8 = "experts_int8"
GATE, UP, DOWN = 0, 1, "down"  # shard ids of per-expert checkpoint tensors


def topk_sigmoid_routing(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4 routing: the k largest raw logits, each squashed by a sigmoid (not renormalized).

    Returns (weights [T, k] float32, expert ids [T, k]).
    """
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.sigmoid(values.float()), ids


def topk_softmax_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE routing: a softmax over all experts in float32, its k largest probabilities, divided by
    their sum when `renormalize` (Qwen3-MoE's `norm_topk_prob`).

    Returns (weights [T, k] float32, expert ids [T, k]).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, ids


def topk_then_softmax_routing(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: the k largest logits, then a softmax over those k only (the other experts never enter the
    normalisation), in float32.

    Returns (weights [T, k] float32, expert ids [T, k]).
    """
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values.float(), dim=-1), ids


# (router logits [T, E], k) -> (weights [T, k] float32, expert ids [T, k])
Routing = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
# An expert's gate_up output [n, 2 * I/tp] (this rank's gate columns, then its up columns) -> [n, I/tp]
GatedActivation = Callable[[torch.Tensor], torch.Tensor]


def expert_params_mapping(num_experts: int, prefix: str = ".experts.",
                          suffixes: tuple[str, ...] = ("weight",)) -> list[tuple[str, str, object]]:
    """Stacked-parameter entries that send per-expert checkpoint tensors into the fused expert tensors.

    `suffixes` are the tensors each expert stores: `weight`, or a quantized checkpoint's (`weight_packed`,
    `weight_scale`, ...), which land in `gate_up_proj_weight_packed` etc. Names that extend `weight` come first,
    as the loader takes the first entry whose checkpoint part a name contains."""
    mapping: list[tuple[str, str, object]] = []
    for suffix in sorted(suffixes, key=lambda s: s == "weight"):
        tail = "" if suffix == "weight" else f"_{suffix}"
        for e in range(num_experts):
            mapping += [(f"{prefix}gate_up_proj{tail}", f"{prefix}{e}.gate_proj.{suffix}", (e, GATE)),
                        (f"{prefix}gate_up_proj{tail}", f"{prefix}{e}.up_proj.{suffix}", (e, UP)),
                        (f"{prefix}down_proj{tail}", f"{prefix}{e}.down_proj.{suffix}", (e, DOWN))]
    return mapping


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (= per output channel of a [out, in] weight): (int8 weight, float32 scale)."""
    w = w.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale


class FusedMoE(nn.Module):
    """All routed experts of one layer as two tensors, laid out for `F.linear` (rows = output channels).

    `gate_up_proj` [E, 2*I/tp, H] holds this rank's gate rows then up rows; `down_proj` [E, H, I/tp].
    The output is this rank's partial sum: the caller all-reduces it (together with any shared expert).
    With `quantization="experts_int8"` both are int8 with a scale per (expert, output channel), quantized
    as each checkpoint tensor arrives, so the full-precision experts never exist in memory.
    A checkpoint that stores its experts quantized replaces both by its stored tensors and sets `quant`
    (strata.layers.quantization.moe_method), which then runs each expert from its packed weights.
    `routing` turns router logits into each token's expert weights and ids (Llama 4's sigmoid by default);
    `activation` gates the gate_up output (SwiGLU by default). With `bias` every expert also has
    `gate_up_proj_bias` [E, 2*I/tp] (gate then up, like the rows) and `down_proj_bias` [E, H], which only TP
    rank 0 holds non-zero so that the all-reduced sum adds it once (gpt-oss).
    """

    quant = None

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 pc: ParallelContext, dtype: torch.dtype, quantization: str | None = None,
                 apply_router_weight_on_input: bool = True, routing: Routing = topk_sigmoid_routing,
                 activation: GatedActivation = silu_and_mul, bias: bool = False) -> None:
        super().__init__()
        self.routing, self.activation = routing, activation
        if intermediate_size % pc.tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by "
                             f"tp_size {pc.tp_size}")
        self.num_experts, self.top_k, self.pc = num_experts, top_k, pc
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.local_intermediate = intermediate_size // pc.tp_size
        self.weight_on_input = apply_router_weight_on_input
        self.quantized = quantization == EXPERTS_INT8
        weight_dtype = torch.int8 if self.quantized else dtype
        i = self.local_intermediate
        self.gate_up_proj = self._param((num_experts, 2 * i, hidden_size), weight_dtype)
        self.down_proj = self._param((num_experts, hidden_size, i), weight_dtype)
        if self.quantized:
            # Buffers, not parameters: they are derived at load, never read from a checkpoint.
            self.register_buffer("gate_up_scale", torch.zeros(num_experts, 2 * i, dtype=dtype))
            self.register_buffer("down_scale", torch.zeros(num_experts, hidden_size, dtype=dtype))
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:  # added after the (possibly int8) matmuls, so they stay in the activations' dtype
            self.gate_up_proj_bias = self._param((num_experts, 2 * i), dtype, self.bias_loader)
            self.down_proj_bias = self._param((num_experts, hidden_size), dtype, self.bias_loader)

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype,
               loader: Callable[..., None] | None = None) -> nn.Parameter:
        p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        p.weight_loader = loader or self.weight_loader
        return p

    @property
    def checkpoint_suffixes(self) -> tuple[str, ...]:
        """The tensors the checkpoint stores per expert and projection."""
        if self.quant is None:
            return ("weight",)
        return tuple({s: None for lays in self.quant.stored_names(self).values() for s in lays})

    @property
    def expert_bytes(self) -> int:
        """Bytes of this rank's expert weights (and scales)."""
        if self.quant is not None:  # before finishing (a shapes-only plan): the stored tensors
            return self.quant.nbytes or sum(p.numel() * p.element_size() for p in self.parameters())
        tensors = [self.gate_up_proj, self.down_proj]
        if self.quantized:
            tensors += [self.gate_up_scale, self.down_scale]
        if self.gate_up_proj_bias is not None:
            tensors += [self.gate_up_proj_bias, self.down_proj_bias]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- loading -------------------------------------------------------------------------------------

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Fused checkpoint tensors ([E, H, 2I] / [E, I, H], used as x @ W) or one expert's [out, in] piece."""
        tp, rank, i = self.pc.tp_size, self.pc.tp_rank, self.local_intermediate
        is_gate_up = param is self.gate_up_proj
        if shard_id is None:
            expected = ((self.num_experts, self.hidden_size, 2 * self.intermediate_size) if is_gate_up
                        else (self.num_experts, self.intermediate_size, self.hidden_size))
            _check_shape(loaded, expected)
            if is_gate_up:  # gate and up halves are sharded separately: a contiguous split of 2I is wrong
                gate, up = loaded.chunk(2, dim=-1)
                rows = torch.cat([shard_dim(gate, 2, rank, tp), shard_dim(up, 2, rank, tp)], dim=2)
                self._store(slice(None), slice(None), rows.transpose(1, 2), is_gate_up)
            else:
                self._store(slice(None), slice(None), shard_dim(loaded, 1, rank, tp).transpose(1, 2), False)
            return
        expert, part = shard_id
        if part == DOWN:
            _check_shape(loaded, (self.hidden_size, self.intermediate_size))
            self._store(expert, slice(None), shard_dim(loaded, 1, rank, tp), False)
        else:
            _check_shape(loaded, (self.intermediate_size, self.hidden_size))
            rows = slice(0, i) if part == GATE else slice(i, 2 * i)
            self._store(expert, rows, shard_dim(loaded, 0, rank, tp), True)

    def bias_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Fused bias tensors: gate_up [E, 2I] (gate half, then up half), each half cut to this rank's columns; down
        [E, H], kept by TP rank 0 alone (every rank's partial output would otherwise add it once more)."""
        tp, rank = self.pc.tp_size, self.pc.tp_rank
        if param is self.gate_up_proj_bias:
            _check_shape(loaded, (self.num_experts, 2 * self.intermediate_size))
            gate, up = loaded.chunk(2, dim=-1)
            param.data.copy_(torch.cat([shard_dim(gate, 1, rank, tp), shard_dim(up, 1, rank, tp)], dim=1))
            return
        _check_shape(loaded, (self.num_experts, self.hidden_size))
        param.data.copy_(loaded if rank == 0 else torch.zeros_like(loaded))

    def _store(self, experts: int | slice, rows: slice, w: torch.Tensor, is_gate_up: bool) -> None:
        param = self.gate_up_proj if is_gate_up else self.down_proj
        if not self.quantized:
            param.data[experts, rows].copy_(w)
            return
        q, scale = quantize_rows_int8(w)
        param.data[experts, rows].copy_(q)
        (self.gate_up_scale if is_gate_up else self.down_scale)[experts, rows].copy_(scale)

    # ---- forward -------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H], router_logits: [T, E] -> this rank's partial output [T, H]."""
        weights, ids = self.routing(router_logits, self.top_k)
        flat_ids = ids.flatten()
        # Group the (token, choice) pairs by expert so each expert runs one matmul over its tokens only.
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        # int8 activations: each token's row rounded once, read by every expert it goes to (llama.cpp's mul_mat_id);
        # a weight on the input makes each (token, expert) input its own, rounded by its own product.
        round_inputs = None if self.weight_on_input else getattr(self.quant, "round_inputs", None)
        rounded = round_inputs(x) if round_inputs is not None else None
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tokens = pairs // self.top_k
            w = flat_weights[pairs].to(x.dtype).unsqueeze(1)
            if rounded is not None:
                y = self.quant.apply_rounded(expert, rounded, tokens) * w
            elif self.weight_on_input:  # the score scales the expert's input, not its output (SwiGLU is not linear)
                y = self._expert(expert, x[tokens] * w)
            else:
                y = self._expert(expert, x[tokens]) * w
            out.index_add_(0, tokens, y)
        return out

    def _expert(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(expert, h)
        if self.gate_up_proj_bias is not None:
            return self._biased_expert(expert, h)
        if not self.quantized:
            return F.linear(self.activation(F.linear(h, self.gate_up_proj[expert])), self.down_proj[expert])
        act = self.activation(_int8_linear(h, self.gate_up_proj[expert], self.gate_up_scale[expert]))
        return _int8_linear(act, self.down_proj[expert], self.down_scale[expert])

    def _biased_expert(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        gate_up_bias, down_bias = self.gate_up_proj_bias[expert], self.down_proj_bias[expert]
        if not self.quantized:
            act = self.activation(F.linear(h, self.gate_up_proj[expert], gate_up_bias))
            return F.linear(act, self.down_proj[expert], down_bias)
        act = self.activation(_int8_linear(h, self.gate_up_proj[expert], self.gate_up_scale[expert]) + gate_up_bias)
        return _int8_linear(act, self.down_proj[expert], self.down_scale[expert]) + down_bias


# torch's CPU weight-only int8 kernel costs grow with the row count (it is a GEMV at heart): measured on
# [1024 -> 2048] it beats dequantize + matmul below ~12 rows and is 4x slower at 256.
_INT8_KERNEL_MAX_ROWS = 12


def _int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (scale * w).T with int8 `w`; a per-output-channel scale can be applied after the matmul."""
    if x.device.type == "cpu" and x.shape[0] <= _INT8_KERNEL_MAX_ROWS:
        return torch._weight_int8pack_mm(x.contiguous(), w, scale.to(x.dtype))
    return F.linear(x, w.to(x.dtype)) * scale.to(x.dtype)


def _check_shape(t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"shape mismatch: expected {expected}, checkpoint has {tuple(t.shape)}")

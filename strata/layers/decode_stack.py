"""A stage's declared decoder layers on the CPU decode path: the step's shared description (rotary cos/sin, slots,
the key ranges of each attention kind), each layer's blocks in one C call apiece, or the whole stack in one call.

The per-layer calls still paid about 60 us a layer in Python (module calls, `serves`, tensors for each block's
output), more after the layers' weights streamed through the caches and left Python's code cold: without tensor
parallelism, and when every layer's feed-forward block is a SwiGLU MLP, all layers (and on the last stage the final
norm) run in one call. Steps with LoRA adapter rows take the same calls, each projection adding its rows' deltas in
C (strata/kernels/cpu/csrc/lora.c) where the layers' slots are float32."""
from __future__ import annotations

import collections
import ctypes

import torch
from torch import nn

from strata.kernels.cpu import cpu_kernels_apply, decode_layer
from strata.kernels.cpu.abi import AttentionBlock, KeyRanges, MlpBlock, Step
from strata.layers.attention import AttentionMetadata
from strata.layers.decode_block import FusedDecodeLayer, Plan, is_decode_step, kernel_norms, norm_kernel_weight
from strata.layers.decoder_layer import DecoderLayerSpec
from strata.layers.lora import LoRAContext


def step_description(meta: AttentionMetadata, windows: list, tokens: int, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None, lora_slots: torch.Tensor | None = None) -> tuple[Step, tuple]:
    """A decode step's slots, rotary cos/sin (left for the callee when None), the key ranges of each attention
    kind in `windows` and each row's LoRA slot (None: no adapter rows), as the C blocks read them, and what it
    points into."""
    ranges, keep = [], [cos, sin, meta.slot_mapping, lora_slots]
    for window, chunk in windows:
        tables, first_keys, seq_lens = meta.decode_key_ranges(window, chunk)
        ranges.append(KeyRanges(max_blocks=tables.shape[1], block_tables=tables.data_ptr(),
                                 first_keys=first_keys.data_ptr(), seq_lens=seq_lens.data_ptr()))
        keep += [tables, first_keys, seq_lens]
    array = (KeyRanges * len(ranges))(*ranges)
    keep.append(array)
    step = Step(tokens=tokens, cos=None if cos is None else cos.data_ptr(),
                 sin=None if sin is None else sin.data_ptr(), ranges=ctypes.cast(array, ctypes.POINTER(KeyRanges)),
                 slots=meta.slot_mapping.data_ptr(), threads=torch.get_num_threads(),
                 lora_slots=None if lora_slots is None else lora_slots.data_ptr())
    return step, tuple(keep)


class FusedDecodeStack:
    """The fused decode path of a stage's layers, read from their declarations, and (on the last stage) its final
    norm."""

    def __init__(self, specs: list[DecoderLayerSpec], final_norm: nn.Module | None) -> None:
        self.final_norm = final_norm
        self.windows: list = []  # the (window, chunk) of every attention kind among the layers
        self.rotaries: list = []  # every rotary embedding among them (Gemma 3: one for local layers, one global)
        self.fused = [FusedDecodeLayer(spec, self.windows, self.rotaries) for spec in specs]
        # The step's cos and sin tables lie back to back, one per rotary, each [tokens, rotary_dim / 2].
        self.enabled = bool(self.fused) and len({r.rotary_dim for r in self.rotaries}) == 1
        self._arrays: tuple | None = None  # (plans, their blocks as C arrays, the widest plan, the fewest rows)
        # Decode steps each path served: "whole step" (FusedDecodeForward), "stack", "blocks" (layer 0's calls).
        self.served: collections.Counter = collections.Counter()
        self.lora: LoRAContext | None = None  # the step's adapter rows, when the model has LoRA slots
        self.adapter_steps = 0  # the served steps with adapter rows

    def lora_slots(self) -> torch.Tensor | None:
        """Each row's LoRA slot of the current step (-1: none), None when no row uses an adapter."""
        return None if self.lora is None else self.lora.batch.row_slots

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's float32 cos and sin of every rotary, [rotaries * tokens, rotary_dim / 2] each."""
        tables = [r._step_cos_sin(positions, torch.float32) for r in self.rotaries]
        if len(tables) == 1:
            return tables[0]
        return torch.cat([cos for cos, _ in tables]), torch.cat([sin for _, sin in tables])

    def step_for(self, meta: AttentionMetadata, positions: torch.Tensor, tokens: int, widest: Plan) -> tuple:
        """(the step's description, a scratch buffer for `widest`'s blocks), built once per step (kept with the
        step's metadata, which every layer sees)."""
        key = ("fused_decode", id(self))
        cached = meta._masks.get(key)
        need = widest.scratch_floats(tokens)
        if cached is None or cached[1].numel() < need:
            cos, sin = self.cos_sin(positions)
            step, keep = step_description(meta, self.windows, tokens, cos, sin, self.lora_slots())
            cached = (ctypes.byref(step), torch.empty(need, dtype=torch.float32), step, keep)
            meta._masks[key] = cached
        return cached[0], cached[1]

    def layer(self, index: int, layer: nn.Module, positions: torch.Tensor, x: torch.Tensor,
              residual: torch.Tensor | None, meta: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index` of the stage: its blocks' C calls when they serve the step, else the layer's modules."""
        fused, slots = self.fused[index], self.lora_slots()
        if not fused.serves(x, meta) or (slots is not None and (not fused.plan.adapters
                                                                 or slots.shape[0] != x.shape[0])):
            return layer(positions, x, residual, meta)
        if index == 0:
            self.served["blocks"] += 1
            self.adapter_steps += slots is not None
        return fused(positions, x, residual, meta, self.step_for(meta, positions, x.shape[0], fused.plan))

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                 meta: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) of the last layer, its output through the final norm when there is one (the residual
        then spent), or None when the step takes the per-layer path."""
        if not cpu_kernels_apply(x) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            return None
        blocks = self.blocks(x.shape[0], meta)
        if blocks is None:
            return None
        attention, mlp, widest, norm_weight = blocks
        step, scratch = self.step_for(meta, positions, x.shape[0], widest)
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        hidden, out = torch.empty_like(x), torch.empty_like(x)
        norm = self.final_norm
        status = decode_layer.library().decode_layers(decode_layer.kernels(), attention, mlp, len(self.fused), step,
                                                      x.data_ptr(), residual.data_ptr(), int(first), scratch.data_ptr(),
                                                      hidden.data_ptr(), out.data_ptr(),
                                                      None if norm is None else norm_weight.data_ptr(),
                                          0.0 if norm is None else norm.eps)
        if status:
            raise MemoryError("decode layers could not allocate their scratch memory")
        self.served["stack"] += 1
        self.adapter_steps += self.lora_slots() is not None
        return (out, residual) if norm is None else (hidden, residual)

    def blocks(self, rows: int, meta: object) -> tuple | None:
        """(attention blocks, MLP blocks, the plan needing the most scratch, the final norm's kernel weight) as C
        arrays for a decode step of `rows` float32 CPU rows, or None when the step takes the per-layer path."""
        if not self.enabled or not is_decode_step(meta, rows):
            return None
        arrays = self._arrays
        if arrays is None or not all(p.current for p in arrays[0]):  # the first decode, or caches bound anew
            plans = [f.plan if f.serves_rows(rows, meta) else None for f in self.fused]
            if any(p is None for p in plans):
                return None
            self._arrays = arrays = self._describe(plans)
            if arrays is None:
                self.enabled = False
                return None
        slots = self.lora_slots()
        if slots is not None and (slots.shape[0] != rows or not all(p.adapters for p in arrays[0])):
            return None
        return arrays[1:5] if rows <= arrays[5] else None

    def _describe(self, plans: list[Plan]) -> tuple | None:
        """The plans' blocks as C arrays, or None when the layers need the per-layer path (tensor parallelism's
        all-reduces between blocks, or a feed-forward block run as modules)."""
        if any(p.mlp is None for p in plans) or any(f.spec.o_proj.pc.tp_size > 1 for f in self.fused):
            return None
        norm = self.final_norm
        if not kernel_norms(norm):
            return None
        attention = (AttentionBlock * len(plans))(*(p.attention for p in plans))
        mlp = (MlpBlock * len(plans))(*(p.mlp for p in plans))
        widest = max(plans, key=lambda p: p.scratch_floats(1))
        norm_weight = None if norm is None else norm_kernel_weight(norm)
        return plans, attention, mlp, widest, norm_weight, min(p.max_rows for p in plans)

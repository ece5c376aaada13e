"""The fused CPU decode paths as one backend, built once by the model runner after loading (the CPU counterpart of
captured CUDA graphs): a single-stage model's whole decode step in one C call, a stage's layers in one call, or each
layer's blocks in one call apiece (tensor parallelism, routed experts), all read from the layers' declarations
(strata/layers/decoder_layer.py) and the model's (ModelArgs: embedding scale, logits divisor, final soft cap).

Built only on CPU and only for a `CausalLM` every layer of whose stage is a declared `DecoderLayer`; each step then
says whether it can take a path (decode-only, few rows, float32 activations, weights the kernels read), and the
runner falls back to `forward` and `compute_logits` when it declines. Steps with LoRA adapter rows take the same
paths (`attach_lora`): each projection adds its rows' deltas in C.
"""
from __future__ import annotations

import collections
import logging

import numpy as np
import torch
from torch import nn

from strata.distributed import IntermediateTensors
from strata.layers.decode_block import is_decode_step
from strata.layers.decode_forward import FusedDecodeForward
from strata.layers.decode_stack import FusedDecodeStack
from strata.layers.decoder_layer import DecoderLayer
from strata.layers.forward_meta import ForwardMeta
from strata.layers.lora import LoRAContext
from strata.models.base import CausalLM

logger = logging.getLogger(__name__)


class CpuDecode:
    """The fused decode paths of one model's stage; `served` counts the decode steps each path took ("whole step",
    "stack", "blocks")."""

    def __init__(self, model: CausalLM) -> None:
        self.model, pc = model, model.pc
        final_norm = model.get_submodule(model.names.norm) if pc.is_last_stage else None
        self.stack = FusedDecodeStack([layer.spec for layer in model.stage_layers], final_norm)
        self.whole_step: FusedDecodeForward | None = None
        if pc.is_first_stage and pc.is_last_stage:
            a, scale = model.args, model.embedding_scale(torch.float32)
            self.whole_step = FusedDecodeForward(self.stack, model.get_submodule(model.names.embedding), model.lm_head,
                                                 1.0 if scale is None else float(scale), a.logits_scaling,
                                                 a.final_softcap or 0.0)

    @classmethod
    def build(cls, model: nn.Module, device: torch.device) -> CpuDecode | None:
        """The backend for `model` on `device`, or None where it has none: not CPU, or a layer of the stage that is
        not a declared pre-norm decoder layer (Llama 4, Mamba2, PLaMo2, a multimodal wrapper)."""
        if device.type != "cpu" or not isinstance(model, CausalLM):
            return None
        layers = model.stage_layers
        if not layers or not all(isinstance(layer, DecoderLayer) for layer in layers):
            return None
        logger.debug("%s fused CPU decode paths built for %d layers", model.pc.log_prefix, len(layers))
        return cls(model)

    @property
    def served(self) -> collections.Counter:
        return self.stack.served

    @property
    def adapter_steps(self) -> int:
        """The served decode steps that had LoRA adapter rows."""
        return self.stack.adapter_steps

    def attach_lora(self, context: LoRAContext) -> None:
        """Read each step's adapter rows from `context` (the LoRA manager's), so steps with them stay fused."""
        self.stack.lora = context

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta
                      ) -> tuple[torch.Tensor, np.ndarray] | None:
        """A decode step's float32 logits (valid until the next step) and each row's argmax from one C call, or None
        when the step takes `forward` and `compute_logits` (or `forward` below)."""
        if self.whole_step is None:
            return None
        return self.whole_step(input_ids, positions, self.model.layer_context(meta))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                intermediate: IntermediateTensors | None) -> torch.Tensor | IntermediateTensors | None:
        """What the model's `forward` returns, for a decode step: every layer in one C call, else each layer's
        blocks in C where they serve it and its modules where not; None for any other step."""
        model, stack = self.model, self.stack
        context = model.layer_context(meta)
        if not is_decode_step(context, positions.shape[0]):
            return None
        x, residual = model.stage_input(input_ids, intermediate)
        stacked = stack(positions, x, residual, context)
        if stacked is None:
            for i, layer in enumerate(model.stage_layers):
                x, residual = stack.layer(i, layer, positions, x, residual, context)
        elif stack.final_norm is not None:  # the call applied the final norm too
            return stacked[0]
        else:
            x, residual = stacked
        return model.stage_output(x, residual)

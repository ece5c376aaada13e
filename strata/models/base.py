"""What every causal LM shares: pipeline staging (this stage's embedding, layers and final norm, placeholders for
the others'), the hand-off between stages, the LM head with its tied-weight loading, and `compute_logits`.

A model subclasses `CausalLM`, names its HF-config translation (`args_class`) and says how to build one decoder
layer; its modules keep the checkpoint's names, so weights load by name and other stages' weights are skipped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import IntermediateTensors, ParallelContext, pp_layer_range
from strata.layers.decode_forward import FusedDecodeForward
from strata.layers.decode_stack import FusedDecodeStack
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from strata.layers.forward_meta import ForwardMeta
from strata.layers.norm import RMSNorm
from strata.layers.quantization.linear_method import finish_quantized, quantize_linears
from strata.models import loader


class PPMissingLayer(nn.Identity):
    """Stands where a module of another pipeline stage would be."""


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """The part of an HF config that staging needs; each model's args dataclass extends it."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    norm_eps: float
    tie_word_embeddings: bool
    embedding_multiplier: float = 1.0  # embeddings are scaled by it (Granite)
    logits_scaling: float = 1.0  # logits are divided by it (Granite)

    @staticmethod
    def common(cfg: HFConfig, *, eps_key: str = "rms_norm_eps", eps: float = 1e-6,
               tied: bool = False) -> dict[str, Any]:
        """The shared fields; `eps` and `tied` are the architecture's defaults when config.json omits them."""
        return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                    norm_eps=cfg.get(eps_key, eps), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied)))


@dataclass(frozen=True)
class CheckpointNames:
    """Module paths of the decoder's parts, as the checkpoint names them (also the parameter name prefixes)."""

    embedding: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str = "model.norm"


class CausalLM(nn.Module):
    """Embedding (first stage; also the last when the LM head is tied to it), decoder layers [start, end) of this
    stage, final norm and LM head (last stage). `forward` returns the final hidden states on the last stage and
    the `IntermediateTensors` for the next stage elsewhere."""

    args_class: ClassVar[type[ModelArgs]]
    names: ClassVar[CheckpointNames] = CheckpointNames()
    stacked_params: loader.StackedMapping = []
    ignored_weights: ClassVar[tuple[str, ...]] = ()  # substrings of checkpoint names the model does not use
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm  # the final norm's (Gemma's weights are offsets from one)

    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None, checkpoint_prefix: str = "") -> None:
        """`checkpoint_prefix`: what the checkpoint puts before this model's module names (`language_model.`
        when it is the text part of a multimodal model), for the quantization config's layer names."""
        super().__init__()
        self.args = args = self.args_class.from_hf(config.text_config)
        self.pc, self.dtype, self.quantization = pc, config.dtype, config.quantization
        self.max_model_len = config.max_model_len  # LongRoPE picks its factors by it, once
        self.start, self.end = pp_layer_range(args.num_layers, pc.pp_rank, pc.pp_size, layer_partition)
        self.missing_prefixes: list[str] = []
        tied, names = args.tie_word_embeddings, self.names
        self._place(names.embedding, pc.is_first_stage or (pc.is_last_stage and tied),
                    lambda: VocabParallelEmbedding(args.vocab_size, args.hidden_size, pc, self.dtype))
        self._place(names.layers, True, lambda: nn.ModuleList(
            self._on_stage(f"{names.layers}.{i}", self.start <= i < self.end, lambda i=i: self.make_layer(i))
            for i in range(args.num_layers)))
        self._place(names.norm, pc.is_last_stage, lambda: self.norm_class(args.hidden_size, args.norm_eps, self.dtype))
        self._place("lm_head", pc.is_last_stage, self._make_lm_head)
        if config.quant_config is not None:
            quantize_linears(self, config.quant_config, self.stacked_params, checkpoint_prefix)
        self.decode_stack = FusedDecodeStack(list(self.get_submodule(names.layers)[self.start:self.end]),
                                             self._final_norm())
        self.decode_forward = self._decode_forward()

    def make_layer(self, index: int) -> nn.Module:
        """Decoder layer `index` (global), called only for this stage's layers."""
        raise NotImplementedError

    def layer_context(self, meta: ForwardMeta) -> Any:
        """What every layer needs of the runner's ForwardMeta, computed once per forward."""
        return meta.attn

    def _final_norm(self) -> nn.Module | None:
        """The final norm, when `finish` is exactly that norm of x + residual (the decode stack applies it)."""
        if not self.pc.is_last_stage or type(self).finish is not CausalLM.finish:
            return None
        return self.get_submodule(self.names.norm)

    def _decode_forward(self) -> FusedDecodeForward | None:
        """The whole-step decode call, for a single-stage model whose `forward` is CausalLM's own and whose
        embedding and LM head ends the call can compute (`fused_decode_ends`)."""
        ends = self.fused_decode_ends()
        if not (self.pc.is_first_stage and self.pc.is_last_stage) or self.decode_stack.final_norm is None \
                or type(self).forward is not CausalLM.forward or ends is None:
            return None
        return FusedDecodeForward(self.decode_stack, self.get_submodule(self.names.embedding), self.lm_head, *ends)

    def fused_decode_ends(self) -> tuple[float, float, float] | None:
        """(embedding scale, logits divisor, final logits soft cap or 0) that `embed_input_ids` and `compute_logits`
        apply around the plain lookup and head, for the whole-step decode call; None when they do something else."""
        cls = type(self)
        if (cls.embed_input_ids, cls.compute_logits) != (CausalLM.embed_input_ids, CausalLM.compute_logits):
            return None
        return self.args.embedding_multiplier, self.args.logits_scaling, 0.0

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta
                      ) -> tuple[torch.Tensor, np.ndarray] | None:
        """A decode step's logits (valid until the next step) and each row's argmax from one C call on CPU, or None
        when the step takes `forward` and `compute_logits`."""
        if self.decode_forward is None:
            return None
        return self.decode_forward(input_ids, positions, self.layer_context(meta))

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output and residual stream -> final hidden states."""
        return self.get_submodule(self.names.norm)(x, residual)[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if self.pc.is_first_stage:
            x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            x, residual = intermediate.hidden_states, intermediate.residual
        context = self.layer_context(meta)
        stacked = self.decode_stack(positions, x, residual, context)  # a CPU decode step: every layer in one call
        if stacked is None:  # each layer: its blocks' C calls on a CPU decode step, else its modules
            for i, layer in enumerate(self.get_submodule(self.names.layers)[self.start:self.end]):
                x, residual = self.decode_stack.layer(i, layer, positions, x, residual, context)
        elif self.decode_stack.final_norm is not None:  # the call applied the final norm too
            return stacked[0]
        else:
            x, residual = stacked
        if not self.pc.is_last_stage:
            # A residual stream kept in float32 (Mamba2) travels in the activations' dtype.
            return IntermediateTensors(x, residual.to(x.dtype))
        return self.finish(x, residual)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.get_submodule(self.names.embedding)(input_ids)
        return x if self.args.embedding_multiplier == 1.0 else x * self.args.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        return logits if self.args.logits_scaling == 1.0 else logits / self.args.logits_scaling

    def rename_weight(self, name: str) -> str:
        """Checkpoint name -> parameter name, for checkpoints that spell a module differently."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            # A tied head has no weight of its own; some checkpoints still store a copy.
            if (self.args.tie_word_embeddings and name == "lm_head.weight") or \
                    any(part in name for part in self.ignored_weights):
                return None
            return self.rename_weight(name)

        loader.load_weights(self, weights, self.stacked_params, rename, self.missing_prefixes)
        finish_quantized(self)

    def _make_lm_head(self) -> ParallelLMHead:
        head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size, self.pc, self.dtype)
        if self.args.tie_word_embeddings:
            head.tie_to(self.get_submodule(self.names.embedding))
        return head

    def _on_stage(self, name: str, present: bool, make: Callable[[], nn.Module]) -> nn.Module:
        """`make()` when this stage holds the module, else a placeholder whose weights the loader skips."""
        if present:
            return make()
        self.missing_prefixes.append(name)
        return PPMissingLayer()

    def _place(self, path: str, present: bool, make: Callable[[], nn.Module]) -> None:
        """Attach the module (or its placeholder) at dotted `path`, creating the plain containers above it."""
        parent_path, _, leaf = path.rpartition(".")
        parent: nn.Module = self
        for part in filter(None, parent_path.split(".")):
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, self._on_stage(path, present, make))

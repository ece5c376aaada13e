"""What every causal LM shares: pipeline staging (this stage's embedding, layers and final norm, placeholders for
the others'), the hand-off between stages, the LM head with its tied-weight loading, `embed_input_ids` and
`compute_logits` with the scales and caps the model declares (ModelArgs).

A model subclasses `CausalLM`, names its HF-config translation (`args_class`) and says how to build one decoder
layer; its modules keep the checkpoint's names, so weights load by name and other stages' weights are skipped.
The fused CPU decode paths are not here: the model runner builds them (strata/executor/cpu_decode.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import IntermediateTensors, ParallelContext, pp_layer_range
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
    embedding_multiplier: float = 1.0  # embeddings are scaled by it (Granite; Gemma's sqrt(hidden))
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    final_softcap: float | None = None  # logits then become cap * tanh(logits / cap) (Gemma 2)

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
        # This stage's layers, in order (a tuple, not a registered container: they are registered under `layers`).
        self.stage_layers: tuple[nn.Module, ...] = tuple(self.get_submodule(names.layers)[self.start:self.end])
        self._embedding_scales: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def make_layer(self, index: int) -> nn.Module:
        """Decoder layer `index` (global), called only for this stage's layers."""
        raise NotImplementedError

    def layer_context(self, meta: ForwardMeta) -> Any:
        """What every layer needs of the runner's ForwardMeta, computed once per forward."""
        return meta.attn

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output and residual stream -> final hidden states."""
        return self.get_submodule(self.names.norm)(x, residual)[0]

    def stage_input(self, input_ids: torch.Tensor, intermediate: IntermediateTensors | None = None,
                    inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) entering this stage's first layer: the embeddings (first stage) or the previous stage's."""
        if self.pc.is_first_stage:
            return (inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)), None
        return intermediate.hidden_states, intermediate.residual

    def stage_output(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | IntermediateTensors:
        """The final hidden states on the last stage, else the hand-off to the next stage."""
        if not self.pc.is_last_stage:
            # A residual stream kept in float32 (Mamba2) travels in the activations' dtype.
            return IntermediateTensors(x, residual.to(x.dtype))
        return self.finish(x, residual)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        x, residual = self.stage_input(input_ids, intermediate, inputs_embeds)
        context = self.layer_context(meta)
        for layer in self.stage_layers:
            x, residual = layer(positions, x, residual, context)
        return self.stage_output(x, residual)

    def embedding_scale(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """`embedding_multiplier` as embeddings of `dtype` are multiplied by it, or None when it is 1: rounded to
        float32, then to `dtype` (transformers' rule for Gemma's sqrt(hidden); Granite's multipliers are exact in
        any of these dtypes). The one definition both the torch path and the C whole step read."""
        multiplier = self.args.embedding_multiplier
        if multiplier == 1.0:
            return None
        key = (dtype, torch.device(device))
        if key not in self._embedding_scales:
            self._embedding_scales[key] = torch.tensor(multiplier, dtype=torch.float32, device=device).to(dtype)
        return self._embedding_scales[key]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.get_submodule(self.names.embedding)(input_ids)
        scale = self.embedding_scale(x.dtype, x.device)
        return x if scale is None else x * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        a = self.args
        if a.logits_scaling != 1.0:
            logits = logits / a.logits_scaling
        return logits if a.final_softcap is None else torch.tanh(logits / a.final_softcap) * a.final_softcap

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

"""Pipeline-parallel scaffolding shared by every model: which modules live on this stage.

Modules of other stages are `PPMissingLayer` placeholders, so global layer indices and parameter
names stay those of the checkpoint; their names are recorded so the loader skips their weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.config import HFConfig
from strata.distributed import ParallelContext
from strata.layers.embedding import ParallelLMHead, VocabParallelEmbedding


class PPMissingLayer(nn.Identity):
    """Stands where a module of another pipeline stage would be."""


def on_stage(present: bool, make: Callable[[], nn.Module], name: str, missing: list[str]) -> nn.Module:
    """`make()` when this stage holds the module, else a placeholder whose weights the loader skips."""
    if present:
        return make()
    missing.append(name)
    return PPMissingLayer()


def stage_layers(num_layers: int, start: int, end: int, make_layer: Callable[[int], nn.Module], prefix: str,
                 missing: list[str]) -> nn.ModuleList:
    """All `num_layers` positions; layers [start, end) are built, the others are placeholders."""
    return nn.ModuleList(on_stage(start <= i < end, lambda i=i: make_layer(i), f"{prefix}.{i}", missing)
                         for i in range(num_layers))


def stage_embedding(cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype, name: str, missing: list[str],
                    tied: bool) -> nn.Module:
    """The token embedding: on the first stage, and on the last too when the LM head is tied to it."""
    return on_stage(pc.is_first_stage or (pc.is_last_stage and tied),
                    lambda: VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pc, dtype), name, missing)


def stage_lm_head(cfg: HFConfig, pc: ParallelContext, dtype: torch.dtype, embedding: nn.Module,
                  missing: list[str], tied: bool) -> nn.Module:
    """The LM head, on the last stage only; a tied head shares the embedding's weight."""
    def make() -> ParallelLMHead:
        head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pc, dtype)
        if tied:
            head.tie_to(embedding)
        return head

    return on_stage(pc.is_last_stage, make, "lm_head", missing)

"""What the layers of one forward pass need to know about the step's batch, built once per step by the runner."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.layers.attention import AttentionMetadata
from strata.layers.mamba.mixer import MambaBatch


@dataclass
class ForwardMeta:
    attn: AttentionMetadata
    mamba: MambaBatch | None = None  # models with Mamba layers: how the step's sequences use their state slots
    mm_inputs: list = field(default_factory=list)  # per sequence: its images (multimodal models), or None
    logits_indices: torch.Tensor | None = None  # rows of the last stage's output whose next token is sampled

"""Gemma 3 with images: the SigLIP vision encoder, the multimodal projector (average pooling to
`mm_tokens_per_image` tokens, a Gemma RMSNorm, a linear map) and the Gemma 3 language model, whose prefill lets one
image's tokens attend to each other."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import ParallelContext
from strata.errors import ConfigError, RequestError
from strata.layers.forward_meta import ForwardMeta
from strata.layers.image_block_attention import ImageBlockAttention, ImageBlockMetadata, image_blocks
from strata.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from strata.layers.norm import GemmaRMSNorm
from strata.models.base import PPMissingLayer
from strata.models.gemma import Gemma3ForCausalLM

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class SiglipVisionArgs:
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> SiglipVisionArgs:
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU_TANH:
            raise ConfigError(f"vision_config.hidden_act {act!r} is not supported (SigLIP uses gelu_pytorch_tanh)")
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                   intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
                   image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=cfg.get("num_channels", 3),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-6))


class SiglipAttention(nn.Module):
    """Bidirectional attention over one image's patches, heads split across TP ranks."""

    def __init__(self, a: SiglipVisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = a.hidden_size // a.num_heads
        self.qkv_proj = QKVParallelLinear(a.hidden_size, self.head_dim, a.num_heads, a.num_heads, pc, True, dtype)
        self.out_proj = RowParallelLinear(a.hidden_size, a.hidden_size, pc, True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = (t.view(n, length, -1, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj.split_qkv(self.qkv_proj(x)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class SiglipMLP(nn.Module):
    def __init__(self, a: SiglipVisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(a.hidden_size, a.intermediate_size, pc, True, dtype=dtype)
        self.fc2 = RowParallelLinear(a.intermediate_size, a.hidden_size, pc, True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, a: SiglipVisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(a.hidden_size, a.layer_norm_eps, dtype=dtype)
        self.self_attn = SiglipAttention(a, pc, dtype)
        self.layer_norm2 = nn.LayerNorm(a.hidden_size, a.layer_norm_eps, dtype=dtype)
        self.mlp = SiglipMLP(a, pc, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionEmbeddings(nn.Module):
    """Non-overlapping patches (a strided convolution) plus a learned position embedding per patch."""

    def __init__(self, a: SiglipVisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(a.num_channels, a.hidden_size, a.patch_size, a.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding((a.image_size // a.patch_size) ** 2, a.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, patches, hidden], row-major
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """Images [N, 3, S, S] -> patch features [N, (S / patch)², hidden] (the last hidden state, no pooling head)."""

    def __init__(self, a: SiglipVisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(a, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(a, pc, dtype) for _ in range(a.num_layers))
        self.post_layernorm = nn.LayerNorm(a.hidden_size, a.layer_norm_eps, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels.to(self.post_layernorm.weight.dtype))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    """Patch features -> `mm_tokens_per_image` soft tokens: average pooling over square windows of the patch grid,
    a Gemma RMSNorm, then one matrix into the language model's width."""

    def __init__(self, a: SiglipVisionArgs, text_hidden: int, tokens_per_image: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.patches_per_side = a.image_size // a.patch_size
        tokens_per_side = math.isqrt(tokens_per_image)
        if tokens_per_side ** 2 != tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ConfigError(f"mm_tokens_per_image={tokens_per_image} must be a square whose side divides the "
                              f"{self.patches_per_side}-patch grid side")
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_soft_emb_norm = GemmaRMSNorm(a.hidden_size, a.layer_norm_eps, dtype)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(a.hidden_size, text_hidden, dtype=dtype),
                                                       requires_grad=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The Gemma 3 language model with the vision tower and projector on the first pipeline stage. Checkpoint names
    are mapped onto this module's: the language model's nesting (transformers 5 `model.language_model.*`, older
    `language_model.model.*`), the tower's (`vision_tower.vision_model.*` or `vision_tower.*`)."""

    attention_class = ImageBlockAttention
    # SigLIP's attention-pooling head: Gemma 3 reads the last hidden state, never the pooled output.
    ignored_weights = ("rotary_emb.inv_freq", "vision_tower.head.", "vision_model.head.")
    _NESTINGS = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                 ("model.multi_modal_projector.", "multi_modal_projector."))

    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None) -> None:
        super().__init__(config, pc, layer_partition)
        hf = config.hf_config
        self.image_token_id = hf.get("image_token_index", hf.get("image_token_id"))
        if pc.is_first_stage:
            vision = SiglipVisionArgs.from_hf(hf.vision_config)
            self.vision_tower = SiglipVisionModel(vision, pc, self.dtype)
            self.multi_modal_projector = Gemma3MultiModalProjector(
                vision, self.args.hidden_size, hf.get("mm_tokens_per_image", 256), self.dtype)
        else:
            self.vision_tower, self.multi_modal_projector = PPMissingLayer(), PPMissingLayer()
            self.missing_prefixes += ["vision_tower", "multi_modal_projector"]

    def rename_weight(self, name: str) -> str:
        for nested, own in self._NESTINGS:
            if name.startswith(nested):
                name = own + name[len(nested):]
                break
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)

    def layer_context(self, meta: ForwardMeta) -> Any:
        """The attention metadata, with the step's image blocks when a prefill chunk holds image tokens."""
        attn = meta.attn
        if not attn.prefills or not any(m is not None for m in meta.mm_inputs):
            return attn
        first_prefill = len(meta.mm_inputs) - len(attn.prefills)  # the step's requests come decodes first
        spans = [None if m is None else m.bidirectional_spans for m in meta.mm_inputs[first_prefill:]]
        blocks = image_blocks(attn, spans)
        return ImageBlockMetadata.of(attn, blocks) if blocks else attn

    def embed_multimodal(self, mm_inputs: Any, prompt_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt positions of the image soft tokens, their embeddings [F, H]) for one request: each image's
        `mm_tokens_per_image` tokens, in order, fill the soft-token positions in order."""
        device = self.multi_modal_projector.mm_input_projection_weight.device
        pixels = torch.cat([p.to(device) for p in mm_inputs.pixel_values], dim=0)
        embeds = self.multi_modal_projector(self.vision_tower(pixels))
        embeds = embeds.reshape(-1, embeds.shape[-1])
        ids = torch.tensor(prompt_token_ids, device=embeds.device)
        positions = (ids == self.image_token_id).nonzero().flatten()
        if positions.numel() != embeds.shape[0]:
            raise RequestError(f"the prompt has {positions.numel()} image tokens but its images give "
                               f"{embeds.shape[0]} features", param="multi_modal_data")
        return positions, embeds

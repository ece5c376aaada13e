"""Llama 4 multimodal model: the vision encoder (tiles -> patches -> ViT with 2-D RoPE), pixel shuffle,
adapter and projector, in front of the Llama 4 language model (spec llama4.md §4, §5.5)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import Collective, IntermediateTensors, ParallelContext, StepSize, module_collectives
from strata.errors import RequestError
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from strata.layers.rotary import rope_parameters
from strata.models import loader
from strata.models.base import PPMissingLayer
from strata.models.llama4 import Llama4ForCausalLM

# transformers builds every vision LayerNorm with the default eps, whatever `norm_eps` says.
_LAYER_NORM_EPS = 1e-5
_LANGUAGE_PREFIX = "language_model."


@dataclass(frozen=True)
class Llama4VisionArgs:
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_layers: int
    image_size: int
    patch_size: int
    num_channels: int
    pixel_shuffle_ratio: float
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int
    rope_theta: float

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Llama4VisionArgs:
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                   intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
                   image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=cfg.get("num_channels", 3),
                   pixel_shuffle_ratio=cfg.get("pixel_shuffle_ratio", 0.5),
                   projector_input_dim=cfg.projector_input_dim, projector_output_dim=cfg.projector_output_dim,
                   vision_output_dim=cfg.get("vision_output_dim", cfg.projector_output_dim),
                   rope_theta=rope_parameters(cfg)[0])


def vision_rope_angles(grid: int, head_dim: int, theta: float) -> torch.Tensor:
    """[grid² + 1, head_dim / 2] rotation angle of each complex pair; the CLS token (last) is not rotated.

    The first half of the pairs turns with the patch column, the second half with its row (both 1-based).
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2)[: head_dim // 4].float() / (head_dim // 2)))
    index = torch.arange(grid * grid)
    cols, rows = (index % grid + 1).float(), (index // grid + 1).float()
    angles = torch.cat([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1)
    return torch.cat([angles, torch.zeros(1, angles.shape[1])], dim=0)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (x[2j], x[2j+1]) by the angle of pair j, in float32."""
    x32 = x.float()
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """[N, g*g, C] -> [N, (g*r)², C/r²]: each output token concatenates an s x s block of patches
    (s = 1/r), row parity major, column parity minor."""
    n, patches, channels = x.shape
    grid, s = math.isqrt(patches), round(1 / ratio)
    x = x.view(n, grid // s, s, grid // s, s, channels).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, (grid // s) ** 2, s * s * channels)


class Llama4VisionAttention(nn.Module):
    """Bidirectional attention over one tile's patches, heads split across TP ranks."""

    def __init__(self, hidden: int, num_heads: int, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_heads, pc, True, dtype)
        self.o_proj = RowParallelLinear(hidden, hidden, pc, True, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = (t.view(n, length, -1, self.head_dim) for t in self.qkv_proj.split_qkv(self.qkv_proj(x)))
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(n, length, -1))


class Llama4VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, intermediate, pc, True, dtype=dtype)
        self.fc2 = RowParallelLinear(intermediate, hidden, pc, True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Llama4VisionEncoderLayer(nn.Module):
    def __init__(self, a: Llama4VisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = a.hidden_size
        self.self_attn = Llama4VisionAttention(hidden, a.num_heads, pc, dtype)
        self.mlp = Llama4VisionMLP(hidden, a.intermediate_size, pc, dtype)
        self.input_layernorm = nn.LayerNorm(hidden, _LAYER_NORM_EPS, dtype=dtype)
        self.post_attention_layernorm = nn.LayerNorm(hidden, _LAYER_NORM_EPS, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionEncoder(nn.Module):
    def __init__(self, a: Llama4VisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Llama4VisionEncoderLayer(a, pc, dtype) for _ in range(a.num_layers))


class Llama4PatchEmbedding(nn.Module):
    """Non-overlapping patches flattened as (channel, row, col), then one linear map (no bias)."""

    def __init__(self, a: Llama4VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = a.patch_size
        self.linear = ReplicatedLinear(a.num_channels * a.patch_size ** 2, a.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(pixels, kernel_size=self.patch_size, stride=self.patch_size)
        return self.linear(patches.transpose(1, 2))


class Llama4VisionAdapter(nn.Module):
    """GELU after both layers (the released model's adapter), split across TP ranks like an MLP."""

    def __init__(self, a: Llama4VisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(a.intermediate_size, a.projector_input_dim, pc, dtype=dtype)
        self.fc2 = RowParallelLinear(a.projector_output_dim, a.projector_output_dim, pc, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class Llama4VisionModel(nn.Module):
    """Tiles [N, 3, S, S] -> [N, tokens per tile, vision_output_dim]."""

    def __init__(self, a: Llama4VisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        grid, hidden = a.image_size // a.patch_size, a.hidden_size
        self.pixel_shuffle_ratio = a.pixel_shuffle_ratio
        self.patch_embedding = Llama4PatchEmbedding(a, dtype)
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.positional_embedding_vlm = nn.Parameter(torch.empty(grid * grid + 1, hidden, dtype=dtype),
                                                     requires_grad=False)
        self.layernorm_pre = nn.LayerNorm(hidden, _LAYER_NORM_EPS, dtype=dtype)
        self.layernorm_post = nn.LayerNorm(hidden, _LAYER_NORM_EPS, dtype=dtype)
        self.model = Llama4VisionEncoder(a, pc, dtype)
        self.vision_adapter = nn.Module()
        self.vision_adapter.mlp = Llama4VisionAdapter(a, pc, dtype)
        angles = vision_rope_angles(grid, hidden // a.num_heads, a.rope_theta)
        self.register_buffer("rope_cos", angles.cos()[:, None, :], persistent=False)  # [L, 1, D/2]
        self.register_buffer("rope_sin", angles.sin()[:, None, :], persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.class_embedding.dtype))
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = self.layernorm_pre(torch.cat([x, cls], dim=1) + self.positional_embedding_vlm)
        for layer in self.model.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        x = self.layernorm_post(x)[:, :-1]  # drop CLS
        return self.vision_adapter.mlp(pixel_shuffle(x, self.pixel_shuffle_ratio))


class Llama4MultiModalProjector(nn.Module):
    def __init__(self, vision_dim: int, text_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = ReplicatedLinear(vision_dim, text_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


class Llama4ForConditionalGeneration(nn.Module):
    """Vision tower + projector on the first pipeline stage only; the language model is a sub-module
    named `language_model`, so its module names (and global layer indices) equal the checkpoint's."""

    stacked_params: loader.StackedMapping = [
        (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
    ]

    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None) -> None:
        super().__init__()
        hf, dtype = config.hf_config, config.dtype
        self.pc = pc
        self.image_token_id = hf.get("image_token_index", hf.get("image_token_id"))
        self.language_model = Llama4ForCausalLM(config, pc, layer_partition, checkpoint_prefix=_LANGUAGE_PREFIX)
        self.missing_prefixes = [_LANGUAGE_PREFIX + p for p in self.language_model.missing_prefixes]
        if pc.is_first_stage:
            vision = Llama4VisionArgs.from_hf(hf.vision_config)
            self.vision_model = Llama4VisionModel(vision, pc, dtype)
            self.multi_modal_projector = Llama4MultiModalProjector(vision.vision_output_dim,
                                                                   self.language_model.args.hidden_size, dtype)
        else:
            self.vision_model, self.multi_modal_projector = PPMissingLayer(), PPMissingLayer()
            self.missing_prefixes += ["vision_model", "multi_modal_projector"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.language_model(input_ids, positions, meta, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def collectives(self, step: StepSize) -> list[Collective]:
        """A step's collectives; the vision tower's come on top, per image, in the steps that encode one."""
        return module_collectives(self.language_model, step)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, mm_inputs: Any, prompt_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt positions of the image-feature tokens, their embeddings [F, H]) for one request.

        Features of all tiles of all images, in order, fill the `<|patch|>` positions in order.
        """
        device = self.vision_model.class_embedding.device
        pixels = torch.cat([p.to(device) for p in mm_inputs.pixel_values], dim=0)
        features = self.vision_model(pixels)
        embeds = self.multi_modal_projector(features.reshape(-1, features.shape[-1]))
        ids = torch.tensor(prompt_token_ids, device=embeds.device)
        positions = (ids == self.image_token_id).nonzero().flatten()
        if positions.numel() != embeds.shape[0]:
            raise RequestError(f"the prompt has {positions.numel()} image tokens but its images give "
                               f"{embeds.shape[0]} features", param="multi_modal_data")
        return positions, embeds

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every `language_model.*` tensor (lm_head included) goes through the language model's own loader,
        which skips the modules of other stages; vision and projector tensors are loaded here."""
        others: list[tuple[str, torch.Tensor]] = []

        def language_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_LANGUAGE_PREFIX):
                    yield name[len(_LANGUAGE_PREFIX):], tensor
                else:
                    others.append((name, tensor))  # the vision part is < 1% of the checkpoint

        self.language_model.load_weights(language_weights())
        vision_part = nn.ModuleDict({"vision_model": self.vision_model,
                                     "multi_modal_projector": self.multi_modal_projector})
        loader.load_weights(vision_part, others, self.stacked_params,
                            missing_prefixes=[p for p in self.missing_prefixes if not p.startswith(_LANGUAGE_PREFIX)])

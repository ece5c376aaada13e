"""Qwen2.5-VL: the vision transformer (patches embedded as one linear map, 2-D rotary, window attention except in
the `fullatt_block_indexes` blocks, RMSNorm, SwiGLU, 2 x 2 patch merger) in front of Qwen2's language model, whose
rotary turns with M-RoPE positions (temporal, height, width rows for image tokens)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from strata.config import HFConfig, ModelConfig
from strata.distributed import ParallelContext
from strata.errors import ConfigError, RequestError
from strata.layers.decoder_layer import GatedMLP
from strata.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.models.base import ModelArgs, PPMissingLayer
from strata.models.dense_decoder import DenseArgs, Qwen2Args, Qwen2ForCausalLM, qwen_layer_windows

_VISION_EPS = 1e-6  # transformers builds every vision RMSNorm with it


@dataclass(frozen=True)
class Qwen2_5_VisionArgs:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Qwen2_5_VisionArgs:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"vision_config.hidden_act {cfg.hidden_act!r} is not supported (Qwen2.5-VL: silu)")
        rope = cfg.get("rope_parameters") or {}
        return cls(depth=cfg.depth, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                   intermediate_size=cfg.intermediate_size, patch_size=cfg.get("patch_size", 14),
                   temporal_patch_size=cfg.get("temporal_patch_size", 2), in_channels=cfg.get("in_channels", 3),
                   merge_size=cfg.get("spatial_merge_size", 2), window_size=cfg.get("window_size", 112),
                   out_hidden_size=cfg.out_hidden_size,
                   fullatt_block_indexes=tuple(cfg.get("fullatt_block_indexes", (7, 15, 23, 31))),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


def rotate_half_float(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of [N, H, D] in float32, back in x's dtype (transformers' vision rotary)."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional attention within each span of `cu_seqlens` (a window, or a whole image), heads split across
    TP ranks; the checkpoint's fused `qkv` loads as q, k, v pieces (see `split_fused_qkv`)."""

    def __init__(self, a: Qwen2_5_VisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = a.hidden_size // a.num_heads
        self.qkv_proj = QKVParallelLinear(a.hidden_size, self.head_dim, a.num_heads, a.num_heads, pc, True, dtype)
        self.proj = RowParallelLinear(a.hidden_size, a.hidden_size, pc, True, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, -1, self.head_dim) for t in self.qkv_proj.split_qkv(self.qkv_proj(x)))
        q, k = rotate_half_float(q, cos, sin), rotate_half_float(k, cos, sin)
        out = q.new_empty(n, q.shape[1] * self.head_dim)
        for start, end, count in equal_span_runs(cu_seqlens):
            # [spans, H, L, D] views: one 4-D call per run of equal spans (a 3-D call misses torch's CPU flash
            # kernel for its unfused math path, ~2.5x slower at a 1024 x 768 image's 3996 patches)
            q_, k_, v_ = (t[start:end].unflatten(0, (count, -1)).transpose(1, 2) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2).reshape(end - start, -1)
        return self.proj(out)


def equal_span_runs(cu_seqlens: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, spans) of each run of consecutive spans of one length: the full windows of a row of windows."""
    runs: list[tuple[int, int, int]] = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        if runs and end - start == (runs[-1][1] - runs[-1][0]) // runs[-1][2]:
            runs[-1] = (runs[-1][0], end, runs[-1][2] + 1)
        elif end > start:
            runs.append((start, end, 1))
    return runs


class VisionBlock(nn.Module):
    def __init__(self, a: Qwen2_5_VisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = RMSNorm(a.hidden_size, _VISION_EPS, dtype)
        self.norm2 = RMSNorm(a.hidden_size, _VISION_EPS, dtype)
        self.attn = VisionAttention(a, pc, dtype)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, pc, dtype, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """transformers' Conv3d with stride = kernel over (frames, rows, columns): a linear map of each flattened patch."""

    def __init__(self, a: Qwen2_5_VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (a.hidden_size, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1))


class PatchMerger(nn.Module):
    """RMSNorm, then each 2 x 2 block of neighbouring patches (consecutive rows) concatenated through a GELU MLP."""

    def __init__(self, a: Qwen2_5_VisionArgs, dtype: torch.dtype) -> None:
        super().__init__()
        width = a.hidden_size * a.merge_size ** 2
        self.ln_q = RMSNorm(a.hidden_size, _VISION_EPS, dtype)
        self.mlp = nn.Sequential(ReplicatedLinear(width, width, True, dtype), nn.GELU(),
                                 ReplicatedLinear(width, a.out_hidden_size, True, dtype))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def window_index(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """(order of the merged tokens with each window's tokens together, window boundaries in patches): windows of
    `window` x `window` merged tokens tile each image from its top-left corner (ragged at the right and bottom)."""
    order, bounds, offset = [], [0], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = np.arange(t * rows * cols).reshape(t, rows, cols)
        for frame in range(t):
            for r in range(0, rows, window):
                for c in range(0, cols, window):
                    tokens = index[frame, r:r + window, c:c + window].reshape(-1)
                    order.append(tokens + offset)
                    bounds.append(bounds[-1] + tokens.size * merge * merge)
        offset += t * rows * cols
    return np.concatenate(order), bounds


def rotary_angles(grids: list[tuple[int, int, int]], merge: int, head_dim: int, theta: float) -> torch.Tensor:
    """[patches, head_dim / 2] angles in the patches' order (merge blocks row-major, patches within them): the first
    half turns with the patch row, the second with its column."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    angles = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        cols = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        rows, cols = rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()
        pair = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        angles.append(pair.repeat(t, 1))
    return torch.cat(angles)


class Qwen2_5_VisionTransformer(nn.Module):
    """Flattened patches of several images [patches, C * T * P * P] -> merged tokens [patches / 4, out_hidden]."""

    def __init__(self, a: Qwen2_5_VisionArgs, pc: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        if a.window_size % (a.merge_size * a.patch_size):
            raise ConfigError(f"vision window_size {a.window_size} is not a multiple of spatial_merge_size * "
                              f"patch_size ({a.merge_size * a.patch_size})")
        self.args = a
        self.patch_embed = PatchEmbed(a, dtype)
        self.blocks = nn.ModuleList(VisionBlock(a, pc, dtype) for _ in range(a.depth))
        self.merger = PatchMerger(a, dtype)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        a, unit = self.args, self.args.merge_size ** 2
        order, windows = window_index(grids, a.merge_size, a.window_size // a.merge_size // a.patch_size)
        images = np.cumsum([0] + [h * w for t, h, w in grids for _ in range(t)]).tolist()  # full attention spans
        order_t = torch.from_numpy(order).to(patches.device)
        x = self.patch_embed(patches)
        x = x.view(-1, unit, x.shape[-1])[order_t].reshape(x.shape[0], -1)
        angles = rotary_angles(grids, a.merge_size, a.hidden_size // a.num_heads, a.rope_theta).to(patches.device)
        angles = angles.view(-1, unit, angles.shape[-1])[order_t].reshape(angles.shape[0], -1)
        emb = torch.cat([angles, angles], dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        for i, block in enumerate(self.blocks):
            x = block(x, images if i in a.fullatt_block_indexes else windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order_t)]


@dataclass(frozen=True, kw_only=True)
class Qwen2_5_VLTextArgs(Qwen2Args):
    mrope_section: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: HFConfig) -> Qwen2_5_VLTextArgs:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "mrope") or "mrope_section" not in rope:
            raise ConfigError(f"Qwen2.5-VL's rotary must be M-RoPE with an mrope_section, got {dict(rope)}")
        attention = DenseArgs.attention(cfg)
        attention["rope_scaling"] = None  # M-RoPE's own frequencies are the default ones
        return cls(**ModelArgs.common(cfg), **attention, qkv_bias=True, windows=qwen_layer_windows(cfg),
                   mrope_section=tuple(rope["mrope_section"]))


def _with_top_level_tie(config: ModelConfig) -> ModelConfig:
    """Nested-text checkpoints keep `tie_word_embeddings` at the top level, beside text_config."""
    hf = config.hf_config
    if "text_config" not in hf or "tie_word_embeddings" not in hf:
        return config
    text = {**hf.text_config.to_dict(), "tie_word_embeddings": hf.tie_word_embeddings}
    return dataclasses.replace(config, hf_config=HFConfig({**hf.to_dict(), "text_config": text}))


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2's language model with the vision tower on the first pipeline stage. Checkpoint names: `model.*` and
    `visual.*` (as released and as transformers saves), or transformers' in-memory `model.language_model.*` and
    `model.visual.*`."""

    args: Qwen2_5_VLTextArgs
    args_class = Qwen2_5_VLTextArgs
    uses_mrope = True  # the runner builds each step's M-RoPE positions (strata/layers/mrope.py)
    _NESTINGS = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def __init__(self, config: ModelConfig, pc: ParallelContext,
                 layer_partition: tuple[int, ...] | None = None) -> None:
        config = _with_top_level_tie(config)
        super().__init__(config, pc, layer_partition)
        hf = config.hf_config
        self.image_token_id = hf.get("image_token_id", 151655)
        if pc.is_first_stage:
            vision = Qwen2_5_VisionArgs.from_hf(hf.vision_config)
            if vision.out_hidden_size != self.args.hidden_size:
                raise ConfigError(f"vision_config.out_hidden_size {vision.out_hidden_size} is not the language "
                                  f"model's hidden_size {self.args.hidden_size}")
            self.visual = Qwen2_5_VisionTransformer(vision, pc, self.dtype)
        else:
            self.visual = PPMissingLayer()
            self.missing_prefixes.append("visual")

    def shared_rotary(self) -> RotaryEmbedding:
        if getattr(self, "rotary", None) is None:
            a = self.args
            self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, None, max_model_len=self.max_model_len,
                                          mrope_section=a.mrope_section)
        return self.rotary

    def rename_weight(self, name: str) -> str:
        for nested, own in self._NESTINGS:
            if name.startswith(nested):
                return own + name[len(nested):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused_qkv(weights))

    def embed_multimodal(self, mm_inputs: Any, prompt_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt positions of the image tokens, their embeddings [F, H]) for one request: all images through the
        tower at once (windows and full attention never cross an image), in prompt order."""
        device = self.visual.patch_embed.proj.weight.device
        patches = torch.cat([p.to(device) for p in mm_inputs.pixel_values], dim=0)
        embeds = self.visual(patches, [tuple(g) for g in mm_inputs.grid_thw])
        ids = torch.tensor(prompt_token_ids, device=embeds.device)
        positions = (ids == self.image_token_id).nonzero().flatten()
        if positions.numel() != embeds.shape[0]:
            raise RequestError(f"the prompt has {positions.numel()} image tokens but its images give "
                               f"{embeds.shape[0]} features", param="multi_modal_data")
        return positions, embeds


def split_fused_qkv(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The vision blocks' fused `attn.qkv.*` tensors as `attn.q_proj.*`, `k_proj`, `v_proj` thirds, which the
    stacked mapping loads into each TP rank's heads."""
    for name, tensor in weights:
        if ".attn.qkv." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0), strict=True):
                yield name.replace(".attn.qkv.", f".attn.{part}."), piece
        else:
            yield name, tensor

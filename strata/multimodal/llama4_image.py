"""Llama 4 image preprocessing (canvas choice, resize, pad, normalize, tiles + global tile) and the
image placeholder tokens that stand for an image in the prompt (spec llama4.md §4.1, §4.4).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from strata.errors import ConfigError, RequestError
from strata.multimodal.image_loading import to_rgb

IMAGE_START = "<|image_start|>"
IMAGE_END = "<|image_end|>"
IMAGE = "<|image|>"  # one per image in the user prompt; the expansion keeps one, before the global tile
PATCH = "<|patch|>"  # one per vision feature; these rows get the image embeddings
TILE_X_SEPARATOR = "<|tile_x_separator|>"
TILE_Y_SEPARATOR = "<|tile_y_separator|>"
PLACEHOLDER_TOKENS = (IMAGE_START, IMAGE, PATCH, TILE_X_SEPARATOR, TILE_Y_SEPARATOR, IMAGE_END)


@dataclass(frozen=True)
class Llama4ImageConfig:
    """What preprocessing and prompt expansion need; defaults are the released models' values."""

    tile_size: int = 336
    patch_size: int = 14
    pixel_shuffle_ratio: float = 0.5
    max_patches: int = 16  # most tiles on the canvas (the global tile not counted)
    resize_to_max_canvas: bool = False
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_token_id: int = 200092  # <|patch|>
    boi_token_id: int = 200080  # <|image_start|>
    eoi_token_id: int = 200081  # <|image_end|>

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | Any, preprocessor_config: Mapping[str, Any] | None = None
    ) -> Llama4ImageConfig:
        """Build from a Llama 4 config (dict or transformers object) and optionally preprocessor_config.json.

        Missing fields fall back to the defaults of transformers' Llama4ImageProcessor / Llama4Processor.
        """
        vision = _field(config, "vision_config") or {}
        pre = preprocessor_config or {}
        size = pre.get("size") or {}
        defaults = cls()
        tile = _field(vision, "image_size") or size.get("height") or defaults.tile_size
        result = cls(
            tile_size=int(tile),
            patch_size=int(_field(vision, "patch_size") or defaults.patch_size),
            pixel_shuffle_ratio=float(_field(vision, "pixel_shuffle_ratio") or defaults.pixel_shuffle_ratio),
            max_patches=int(pre.get("max_patches") or defaults.max_patches),
            resize_to_max_canvas=bool(pre.get("resize_to_max_canvas", defaults.resize_to_max_canvas)),
            rescale_factor=float(pre.get("rescale_factor") or defaults.rescale_factor),
            image_mean=_per_channel(pre.get("image_mean") or defaults.image_mean),
            image_std=_per_channel(pre.get("image_std") or defaults.image_std),
            image_token_id=int(_first_field(config, "image_token", defaults.image_token_id)),
            boi_token_id=int(_first_field(config, "boi_token", defaults.boi_token_id)),
            eoi_token_id=int(_first_field(config, "eoi_token", defaults.eoi_token_id)),
        )
        result.validate()
        return result

    def validate(self) -> None:
        grid = self.tile_size // self.patch_size if self.patch_size > 0 else 0
        if grid <= 0 or self.tile_size % self.patch_size:
            raise ConfigError(
                f"vision image_size {self.tile_size} is not a multiple of patch_size {self.patch_size}"
            )
        if grid % round(1 / self.pixel_shuffle_ratio):
            raise ConfigError(
                f"patch grid {grid} cannot be pixel-shuffled with ratio {self.pixel_shuffle_ratio}"
            )
        if self.max_patches < 1:
            raise ConfigError(f"max_patches must be >= 1, got {self.max_patches}")

    @property
    def tokens_per_tile(self) -> int:
        """`<|patch|>` tokens (= vision features) per tile: patches per tile / pixel-shuffle factor."""
        downsample = int(round(1.0 / self.pixel_shuffle_ratio**2))
        return (self.tile_size // self.patch_size) ** 2 // downsample


def _field(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _per_channel(value: float | Sequence[float]) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    return tuple(float(v) for v in value)


def _first_field(obj: Any, stem: str, default: Any) -> Any:
    # Checkpoints spell these `<stem>_index`; transformers objects also answer to `<stem>_id`.
    for name in (f"{stem}_index", f"{stem}_id"):
        value = _field(obj, name)
        if value is not None:
            return value
    return default


# ---------------------------------------------------------------------------------------------------------
# Canvas choice


def supported_canvases(max_patches: int, tile_size: int) -> list[tuple[int, int]]:
    """All (height, width) canvases of rows*cols <= max_patches tiles, in transformers' order."""
    by_aspect: dict[float, list[tuple[int, int]]] = {}
    for num_tiles in range(max_patches, 0, -1):
        for rows in sorted(d for d in range(1, num_tiles + 1) if num_tiles % d == 0):
            cols = num_tiles // rows
            by_aspect.setdefault(rows / cols, []).append((rows, cols))
    return [(r * tile_size, c * tile_size) for group in by_aspect.values() for r, c in group]


def best_canvas(
    image_size: tuple[int, int], canvases: Sequence[tuple[int, int]], resize_to_max_canvas: bool = False
) -> tuple[int, int]:
    """The canvas (height, width) to fit an image of `image_size` (height, width) onto.

    The no-distortion scale of a canvas is min(H_c/h, W_c/w); take the smallest scale >= 1 (the largest
    with `resize_to_max_canvas`), else the largest scale < 1; among equal scales the smallest area.
    """
    height, width = image_size
    res = torch.tensor(canvases, dtype=torch.int64)
    # float32 on purpose, as transformers does: equality of scales decides ties between canvases.
    scale_h = res[:, 0] / height
    scale_w = res[:, 1] / width
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    upscaling = scales[scales >= 1]
    if len(upscaling) > 0:
        selected = upscaling.max() if resize_to_max_canvas else upscaling.min()
    else:
        selected = scales[scales < 1].max()
    chosen = res[scales == selected]
    best = chosen[torch.argmin(chosen[:, 0] * chosen[:, 1])]
    return int(best[0]), int(best[1])


def resized_size(
    image_size: tuple[int, int], canvas: tuple[int, int], tile_size: int, resize_to_max_canvas: bool = False
) -> tuple[int, int]:
    """Size (height, width) the image is resized to, keeping its aspect ratio, before padding to `canvas`.

    Without `resize_to_max_canvas` upscaling stops once a side reaches `tile_size`.
    """
    height, width = image_size
    if resize_to_max_canvas:
        limit_h, limit_w = torch.tensor(canvas[0]), torch.tensor(canvas[1])
    else:
        # transformers computes a scale in float32 when its limit comes from the (tensor) canvas and in
        # float64 when it comes from a Python int; copying that keeps the size identical to the pixel.
        limit_h = min(max(height, tile_size), torch.tensor(canvas[0]))
        limit_w = min(max(width, tile_size), torch.tensor(canvas[1]))
    scale_h = limit_h / height
    scale_w = limit_w / width
    if scale_w < scale_h:
        new_h, new_w = min(math.floor(height * scale_w), limit_h), limit_w
    else:
        new_h, new_w = limit_h, min(math.floor(width * scale_h), limit_w)
    return max(int(new_h), 1), max(int(new_w), 1)


def aspect_ratio_for(image_size: tuple[int, int], config: Llama4ImageConfig) -> tuple[int, int]:
    """Tile grid (rows, cols) of an image of `image_size` (height, width), without touching pixels."""
    canvases = supported_canvases(config.max_patches, config.tile_size)
    canvas = best_canvas(image_size, canvases, config.resize_to_max_canvas)
    return canvas[0] // config.tile_size, canvas[1] // config.tile_size


def num_tiles(aspect_ratio: tuple[int, int]) -> int:
    """Tiles fed to the vision encoder: the grid, plus one global tile when the grid has more than one."""
    grid = aspect_ratio[0] * aspect_ratio[1]
    return grid + 1 if grid > 1 else 1


# ---------------------------------------------------------------------------------------------------------
# Pixels


def preprocess_image(image: Image.Image, config: Llama4ImageConfig) -> tuple[torch.Tensor, tuple[int, int]]:
    """Tile one image: returns pixel values [num_tiles, 3, tile, tile] and the grid (ratio_h, ratio_w).

    Tiles are row-major, the global tile (whole image squashed to one tile) last when the grid has more
    than one tile. Values are bfloat16 computed in bfloat16, exactly as transformers' processor returns
    them; cast to the vision tower's dtype.
    """
    rgb = np.array(to_rgb(image), dtype=np.uint8)
    pixels = torch.from_numpy(rgb).permute(2, 0, 1).unsqueeze(0).contiguous()  # [1, 3, H, W] uint8
    image_size = (pixels.shape[-2], pixels.shape[-1])
    tile = config.tile_size
    canvases = supported_canvases(config.max_patches, tile)
    canvas_h, canvas_w = best_canvas(image_size, canvases, config.resize_to_max_canvas)
    new_h, new_w = resized_size(image_size, (canvas_h, canvas_w), tile, config.resize_to_max_canvas)

    resized = _resize_uint8(pixels, (new_h, new_w))
    padded = F.pad(resized, (0, canvas_w - new_w, 0, canvas_h - new_h), value=0)
    normalized = _rescale_and_normalize(padded, config)[0]
    ratio_h, ratio_w = canvas_h // tile, canvas_w // tile
    tiles = normalized.view(3, ratio_h, tile, ratio_w, tile).permute(1, 3, 0, 2, 4).reshape(-1, 3, tile, tile)
    if ratio_h * ratio_w > 1:
        global_tile = _rescale_and_normalize(_resize_uint8(pixels, (tile, tile)), config)
        tiles = torch.cat([tiles, global_tile], dim=0)
    return tiles.contiguous(), (ratio_h, ratio_w)


def _resize_uint8(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear antialiased resize of uint8 [N, 3, H, W] (PIL-like), as transformers' processor does it."""
    if (pixels.shape[-2], pixels.shape[-1]) == size:
        return pixels
    # Resize the uint8 tensor itself: torchvision (>= 0.2x) does so on AVX2/AVX512/ARM CPUs, and the
    # float32 detour it takes elsewhere differs by one intensity level here and there.
    return F.interpolate(pixels, size=list(size), mode="bilinear", align_corners=False, antialias=True)


def _rescale_and_normalize(pixels: torch.Tensor, config: Llama4ImageConfig) -> torch.Tensor:
    # In bfloat16, as the original Llama 4 code and transformers do, so the values match bit for bit.
    values = pixels.to(torch.bfloat16) * config.rescale_factor
    mean = torch.as_tensor(config.image_mean, dtype=values.dtype).view(-1, 1, 1)
    std = torch.as_tensor(config.image_std, dtype=values.dtype).view(-1, 1, 1)
    return values.sub(mean).div_(std)


# ---------------------------------------------------------------------------------------------------------
# Prompt placeholders


def image_placeholder_tokens(aspect_ratio: tuple[int, int], tokens_per_tile: int) -> list[str]:
    """The token strings that replace one `<|image|>` of the prompt for an image with this tile grid.

    Layout: <|image_start|>, then for a grid of more than one tile each row's tiles (tokens_per_tile
    <|patch|> each) joined by <|tile_x_separator|> and ended by <|tile_y_separator|>; then <|image|>,
    the global (or only) tile's <|patch|> tokens, <|image_end|>.
    """
    ratio_h, ratio_w = aspect_ratio
    tokens = [IMAGE_START]
    if ratio_h * ratio_w > 1:
        for _ in range(ratio_h):
            for col in range(ratio_w):
                tokens.extend([PATCH] * tokens_per_tile)
                if col < ratio_w - 1:
                    tokens.append(TILE_X_SEPARATOR)
            tokens.append(TILE_Y_SEPARATOR)
    tokens.append(IMAGE)
    tokens.extend([PATCH] * tokens_per_tile)
    tokens.append(IMAGE_END)
    return tokens


def image_placeholder_text(aspect_ratio: tuple[int, int], tokens_per_tile: int) -> str:
    """`image_placeholder_tokens` joined into the string transformers' Llama4Processor puts in the prompt."""
    return "".join(image_placeholder_tokens(aspect_ratio, tokens_per_tile))


def num_image_features(aspect_ratio: tuple[int, int], tokens_per_tile: int) -> int:
    """`<|patch|>` tokens (= rows overwritten by vision features) for one image."""
    return num_tiles(aspect_ratio) * tokens_per_tile


def placeholder_token_ids(tokenizer: Any) -> dict[str, int]:
    """Ids of the placeholder tokens in `tokenizer` (anything with `convert_tokens_to_ids`)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    ids: dict[str, int] = {}
    for token in PLACEHOLDER_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (unk is not None and token_id == unk):
            raise ConfigError(f"the tokenizer has no {token} token; it cannot serve Llama 4 images")
        ids[token] = int(token_id)
    return ids


def expand_image_placeholders(
    prompt_ids: Sequence[int],
    aspect_ratios: Sequence[tuple[int, int]],
    tokens_per_tile: int,
    token_ids: Mapping[str, int],
) -> list[int]:
    """Replace the i-th `<|image|>` id of `prompt_ids` by the placeholder ids of the i-th image."""
    image_id = token_ids[IMAGE]
    positions = [i for i, t in enumerate(prompt_ids) if t == image_id]
    if len(positions) != len(aspect_ratios):
        raise RequestError(
            f"the prompt has {len(positions)} {IMAGE} placeholders but {len(aspect_ratios)} images",
            param="messages",
        )
    out: list[int] = []
    start = 0
    for pos, ratio in zip(positions, aspect_ratios, strict=True):
        out.extend(prompt_ids[start:pos])
        out.extend(token_ids[t] for t in image_placeholder_tokens(ratio, tokens_per_tile))
        start = pos + 1
    out.extend(prompt_ids[start:])
    return out

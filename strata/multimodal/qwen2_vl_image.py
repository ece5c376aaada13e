"""Qwen2.5-VL image preprocessing (smart resize within min/max pixels, rescale, normalize, flattened patches) and
the prompt side: each `<|image_pad|>` expanded to the image's merged-patch tokens and the M-RoPE positions of the
prompt, all as transformers' Qwen2_5_VLProcessor and `get_rope_index` compute them."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from strata.config import ModelConfig
from strata.errors import ConfigError, RequestError
from strata.multimodal.image_loading import image_token_runs, images_of, refuse_unknown_processor_kwargs, to_rgb

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# The per-request keywords (vLLM's `mm_processor_kwargs`) this processor reads.
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


@dataclass(frozen=True)
class Qwen2VLImageConfig:
    """What preprocessing and prompt expansion need; defaults are transformers' Qwen2VLImageProcessor's."""

    image_token_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: int = Image.Resampling.BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], pre: Mapping[str, Any] | None) -> Qwen2VLImageConfig:
        """From config.json and preprocessor_config.json (None: transformers' defaults). The preprocessor's
        patch and merge sizes must be the vision tower's."""
        pre, vision = pre or {}, config.get("vision_config") or {}
        if pre.get("do_resize") is False:
            raise ConfigError("preprocessor_config.json sets do_resize false: Qwen2.5-VL images must be resized to "
                              "multiples of patch_size * merge_size")
        size = pre.get("size") or {}
        d = cls(0)
        result = cls(
            image_token_id=int(config.get("image_token_id", config.get("image_token_index", 151655))),
            patch_size=int(pre.get("patch_size") or vision.get("patch_size") or d.patch_size),
            temporal_patch_size=int(pre.get("temporal_patch_size") or vision.get("temporal_patch_size")
                                    or d.temporal_patch_size),
            merge_size=int(pre.get("merge_size") or vision.get("spatial_merge_size") or d.merge_size),
            min_pixels=int(size.get("shortest_edge") or pre.get("min_pixels") or d.min_pixels),
            max_pixels=int(size.get("longest_edge") or pre.get("max_pixels") or d.max_pixels),
            resample=int(pre["resample"]) if pre.get("resample") is not None else d.resample,
            do_rescale=bool(pre.get("do_rescale", True)),
            rescale_factor=float(pre.get("rescale_factor") or d.rescale_factor),
            do_normalize=bool(pre.get("do_normalize", True)),
            image_mean=_per_channel(pre.get("image_mean") or d.image_mean),
            image_std=_per_channel(pre.get("image_std") or d.image_std))
        for key, tower in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                           ("merge_size", "spatial_merge_size")):
            if vision.get(tower) is not None and int(vision[tower]) != getattr(result, key):
                raise ConfigError(f"preprocessor_config.json {key}={getattr(result, key)} but the vision tower's "
                                  f"{tower} is {vision[tower]}")
        return result

    def with_kwargs(self, kwargs: Mapping[str, Any] | None) -> Qwen2VLImageConfig:
        """This config under a request's `mm_processor_kwargs` (min_pixels / max_pixels); other keys refused."""
        if not kwargs:
            return self
        refuse_unknown_processor_kwargs(kwargs, PROCESSOR_KWARGS)
        values = {}
        for key, value in kwargs.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(f"mm_processor_kwargs.{key} must be a positive integer, got {value!r}",
                                   param="mm_processor_kwargs")
            values[key] = value
        result = dataclasses.replace(self, **values)
        if result.min_pixels > result.max_pixels:
            raise RequestError(f"mm_processor_kwargs: min_pixels {result.min_pixels} exceeds max_pixels "
                               f"{result.max_pixels}", param="mm_processor_kwargs")
        return result

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _per_channel(value: float | Sequence[float]) -> tuple[float, ...]:
    return (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) both multiples of `factor`, their product within [min_pixels, max_pixels], the aspect ratio
    kept as closely as that allows (transformers' rule, rounding included)."""
    if max(height, width) / min(height, width) > 200:
        raise RequestError(f"an image of {width}x{height} pixels has an aspect ratio over 200", param="image_url")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_image(image: Image.Image, config: Qwen2VLImageConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(flattened patches [grid_h * grid_w, C * T * P * P] float32, grid (t, h, w) in patches). A PIL resize of
    the RGB image, x * rescale in float64 then float32, (x - mean) / std in float32; patches ordered by 2 x 2
    merge block (row-major), then by patch within it, each flattened as (channel, frame, row, column) with the
    image repeated over the temporal patch (transformers' PIL image processor)."""
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, config.factor, config.min_pixels, config.max_pixels)
    pixels = np.array(rgb.resize((width, height), resample=config.resample), dtype=np.uint8)
    values = pixels.astype(np.float64) * config.rescale_factor if config.do_rescale else pixels
    values = values.astype(np.float32)
    if config.do_normalize:
        values = (values - np.array(config.image_mean, np.float32)) / np.array(config.image_std, np.float32)
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = height // p, width // p
    chw = values.transpose(2, 0, 1)
    patches = chw.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return torch.from_numpy(np.ascontiguousarray(patches).reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)


def expand_image_pads(token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[int]:
    """The i-th `<|image_pad|>` of `token_ids` repeated counts[i] times (the processor's expansion)."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(counts):
        raise RequestError(f"the prompt has {found} {IMAGE_PAD} placeholders but {len(counts)} images",
                           param="messages")
    out, images = [], iter(counts)
    for t in token_ids:
        out.extend([t] * next(images) if t == image_token_id else [t])
    return out


def mrope_prompt_positions(runs: Sequence[tuple[int, int]], grids: Sequence[tuple[int, int, int]], merge: int
                           ) -> tuple[np.ndarray, int]:
    """([3, end of the last image] positions, delta): text tokens count on from the position after the previous
    token on all three rows; an image's tokens take (start + t, start + row, start + column) of its merged grid and
    the text after it goes on from start + max(rows, columns). Tokens past the table are at index + delta."""
    pieces, position, cursor = [], 0, 0
    for (start, end), (t, h, w) in zip(runs, grids, strict=True):
        text = np.arange(start - cursor) + position
        pieces.append(np.broadcast_to(text, (3, text.size)))
        position += start - cursor
        rows, cols = h // merge, w // merge
        grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        pieces.append(np.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + position)
        position += max(rows, cols)
        cursor = end
    table = np.ascontiguousarray(np.concatenate(pieces, axis=1), dtype=np.int64)
    return table, position - cursor


@dataclass
class Qwen2VLImageInputs:
    """The preprocessed images of one request, in prompt order (the `mm_inputs` of a Request)."""

    pixel_values: list[torch.Tensor]  # per image: [patches, C * T * P * P]
    grid_thw: list[tuple[int, int, int]]  # per image, in patches
    cache_key: bytes  # digest of the pixels: prompts with other images never share KV blocks past `first_position`
    first_position: int  # prompt position of the first image token
    mrope_positions: np.ndarray  # [3, end of the last image token] M-RoPE positions of the prompt's start
    mrope_delta: int  # every later token (text, generated) rotates at its index + delta on all three rows


class Qwen2VLImagePromptProcessor:
    """Images -> patches, and a prompt's `<|image_pad|>` -> the image's tokens and M-RoPE positions."""

    accepts_processor_kwargs = True

    def __init__(self, config: Qwen2VLImageConfig, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if pad != config.image_token_id:
            raise ConfigError(f"the tokenizer's {IMAGE_PAD} is id {pad} but config.json says "
                              f"image_token_id={config.image_token_id}")

    @classmethod
    def for_model(cls, model: ModelConfig, tokenizer: Any, pre: Mapping[str, Any] | None
                  ) -> Qwen2VLImagePromptProcessor:
        return cls(Qwen2VLImageConfig.from_hf_config(model.hf_config.to_dict(), pre), tokenizer)

    @property
    def image_placeholder(self) -> str:
        return VISION_START + IMAGE_PAD + VISION_END

    def process(self, token_ids: list[int], images: list[Image.Image],
                mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], Qwen2VLImageInputs]:
        """Expand the i-th `<|image_pad|>` of `token_ids` for the i-th image and patch the images."""
        config = self.config.with_kwargs(mm_processor_kwargs)
        patches, grids = zip(*(preprocess_image(i, config) for i in images), strict=True)
        merge = config.merge_size ** 2
        ids = expand_image_pads(token_ids, config.image_token_id, [t * h * w // merge for t, h, w in grids])
        return ids, self.inputs(ids, list(patches), list(grids))

    def process_text(self, text: str, images: list[Image.Image],
                     mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], Qwen2VLImageInputs]:
        """A rendered conversation: tokenized as it is, then its `<|image_pad|>` ids expanded."""
        return self.process(self.tokenizer(text, add_special_tokens=False).input_ids, images, mm_processor_kwargs)

    def inputs(self, ids: list[int], patches: list[torch.Tensor], grids: list[tuple[int, int, int]]
               ) -> Qwen2VLImageInputs:
        """The request's inputs; its image tokens must form one run per image of the image's size."""
        merge = self.config.merge_size
        runs = image_token_runs(ids, self.config.image_token_id)
        sizes = [t * h * w // merge ** 2 for t, h, w in grids]
        if [e - s for s, e in runs] != sizes:
            raise RequestError(f"the prompt's image token runs {runs} do not match its images' token counts {sizes}",
                               param="multi_modal_data")
        digest = hashlib.blake2b(digest_size=16)
        for p, grid in zip(patches, grids, strict=True):
            digest.update(np.asarray(grid, np.int64).tobytes())
            digest.update(p.numpy().tobytes())
        table, delta = mrope_prompt_positions(runs, grids, merge)
        return Qwen2VLImageInputs(patches, grids, digest.digest(), runs[0][0], table, delta)

    def attach(self, token_ids: list[int], data: Any, mm_processor_kwargs: Mapping[str, Any] | None = None
               ) -> tuple[list[int], Qwen2VLImageInputs | None]:
        """The engine's entry: `multi_modal_data` is Qwen2VLImageInputs, or {"image": image or list of images}."""
        if isinstance(data, Qwen2VLImageInputs):
            self.inputs(token_ids, data.pixel_values, data.grid_thw)  # checks the image tokens against the images
            return token_ids, data
        images = images_of(data)
        return self.process(token_ids, images, mm_processor_kwargs) if images else (token_ids, None)

"""MultiModalConfig: what one request may send to a multimodal model (vLLM's limit_mm_per_prompt, the largest image
decoded) and the size of the decoded-image cache (vLLM's mm_processor_cache_gb), checked once at start-up."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.errors import ConfigError

# Pillow's own decompression-bomb threshold (its Image.MAX_IMAGE_PIXELS): an RGB image this large decodes to 256 MiB.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
_UNSUPPORTED_MODALITIES = ("video", "audio")


@dataclass(frozen=True)
class MultiModalConfig:
    """`image_limit`: most images in one prompt (None: as many as the context holds); `max_image_pixels`: the
    largest width x height decoded (checked from the file's header, before decoding); `cache_bytes`: decoded images
    kept, keyed by their encoded bytes' digest, so that a conversation resending an image skips decoding (0: off)."""

    image_limit: int | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    cache_bytes: int = 4 << 30


def multimodal_config(limit_mm_per_prompt: dict[str, Any] | None, mm_processor_cache_gb: float,
                      max_image_pixels: int, is_multimodal: bool) -> MultiModalConfig:
    """The checked options; a modality strata does not take may only be limited to 0."""
    limits = dict(limit_mm_per_prompt or {})
    for modality, count in limits.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer, got {count!r}",
                              param="limit_mm_per_prompt")
        if modality in _UNSUPPORTED_MODALITIES and count > 0:
            raise ConfigError(f"limit_mm_per_prompt allows {count} {modality} inputs, but strata takes images only; "
                              f"leave {modality} out or set it to 0", param="limit_mm_per_prompt")
        if modality not in ("image", *_UNSUPPORTED_MODALITIES):
            raise ConfigError(f"limit_mm_per_prompt has unknown modality {modality!r} (known: image, video, audio)",
                              param="limit_mm_per_prompt")
    image_limit = limits.get("image")
    if image_limit and not is_multimodal:
        raise ConfigError(f"limit_mm_per_prompt allows {image_limit} images, but this model is text-only",
                          param="limit_mm_per_prompt")
    if not isinstance(mm_processor_cache_gb, (int, float)) or mm_processor_cache_gb < 0:
        raise ConfigError(f"mm_processor_cache_gb must be >= 0 (0: no cache), got {mm_processor_cache_gb!r}",
                          param="mm_processor_cache_gb")
    if not isinstance(max_image_pixels, int) or max_image_pixels < 1:
        raise ConfigError(f"max_image_pixels must be a positive integer, got {max_image_pixels!r}",
                          param="max_image_pixels")
    return MultiModalConfig(image_limit, max_image_pixels, int(mm_processor_cache_gb * (1 << 30)))

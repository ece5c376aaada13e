"""Gemma 3 image preprocessing (pan-and-scan crops, resize to the tower's square, rescale, normalize) and the prompt
expansion of each `<start_of_image>` into the soft tokens of the image and its crops, as transformers' Gemma3Processor
does them."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from strata.config import ModelConfig
from strata.errors import ConfigError, RequestError
from strata.multimodal.image_loading import image_token_runs, images_of, refuse_unknown_processor_kwargs, to_rgb

# Gemma3Processor's values for the pan-and-scan options that preprocessor_config.json leaves null (the released
# checkpoints do); these are also the per-request keywords (vLLM's `mm_processor_kwargs`) this processor reads.
PAN_AND_SCAN_DEFAULTS: dict[str, Any] = {"do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256,
                                         "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
PROCESSOR_KWARGS = tuple(PAN_AND_SCAN_DEFAULTS)


@dataclass(frozen=True)
class Gemma3ImageConfig:
    """What preprocessing and prompt expansion need; defaults are transformers' Gemma3ImageProcessor's."""

    image_size: int
    tokens_per_image: int
    image_token_id: int  # <image_soft_token>: one per soft token; these rows get the image embeddings
    boi_token_id: int  # <start_of_image>: one per image in the rendered prompt
    eoi_token_id: int
    resample: int = Image.Resampling.BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], pre: Mapping[str, Any] | None) -> Gemma3ImageConfig:
        """From config.json and preprocessor_config.json (None: transformers' defaults)."""
        pre = pre or {}
        if pre.get("do_resize") is False:
            raise ConfigError("preprocessor_config.json sets do_resize false: Gemma 3's tower takes "
                              "vision_config.image_size squares only")
        vision = config["vision_config"]
        size = pre.get("size") or {}
        if size and (size.get("height") != vision["image_size"] or size.get("width") != vision["image_size"]):
            raise ConfigError(f"preprocessor_config.json resizes to {size}, but the vision tower takes "
                              f"{vision['image_size']}x{vision['image_size']} images")
        defaults = cls(0, 0, 0, 0, 0)
        # A pan-and-scan option the image processor sets wins over Gemma3Processor's default (vLLM resolves them so;
        # transformers' processor call passes its own defaults over them).
        set_here = {k: v for k, v in pre.items() if k in PAN_AND_SCAN_DEFAULTS and v is not None}
        return cls(image_size=int(vision["image_size"]), tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
                   image_token_id=int(_first(config, "image_token")), boi_token_id=int(_first(config, "boi_token")),
                   eoi_token_id=int(_first(config, "eoi_token")),
                   resample=int(pre.get("resample") if pre.get("resample") is not None else defaults.resample),
                   do_rescale=bool(pre.get("do_rescale", True)),
                   rescale_factor=float(pre.get("rescale_factor") or defaults.rescale_factor),
                   do_normalize=bool(pre.get("do_normalize", True)),
                   image_mean=_per_channel(pre.get("image_mean") or defaults.image_mean),
                   image_std=_per_channel(pre.get("image_std") or defaults.image_std),
                   **_pan_and_scan_options(set_here, lambda m: ConfigError(f"preprocessor_config.json: {m}")))

    def with_kwargs(self, kwargs: Mapping[str, Any] | None) -> Gemma3ImageConfig:
        """This config under a request's `mm_processor_kwargs` (the pan-and-scan options); other keys refused."""
        if not kwargs:
            return self
        refuse_unknown_processor_kwargs(kwargs, PROCESSOR_KWARGS)
        current = {k: getattr(self, k) for k in PROCESSOR_KWARGS}
        options = _pan_and_scan_options({**current, **kwargs},
                                        lambda m: RequestError(f"mm_processor_kwargs.{m}", param="mm_processor_kwargs"))
        return dataclasses.replace(self, **options)


def _pan_and_scan_options(values: Mapping[str, Any], error: Callable[[str], Exception]) -> dict[str, Any]:
    """The four pan-and-scan options, `values` over the processor's defaults, checked (`error` builds the refusal)."""
    options = {**PAN_AND_SCAN_DEFAULTS, **values}
    if not isinstance(options["do_pan_and_scan"], bool):
        raise error(f"do_pan_and_scan must be true or false, got {options['do_pan_and_scan']!r}")
    for key in ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops"):
        if isinstance(options[key], bool) or not isinstance(options[key], int) or options[key] < 1:
            raise error(f"{key} must be a positive integer, got {options[key]!r}")
    ratio = options["pan_and_scan_min_ratio_to_activate"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
        raise error(f"pan_and_scan_min_ratio_to_activate must be a positive number, got {ratio!r}")
    return {**options, "pan_and_scan_min_ratio_to_activate": float(ratio)}


def _first(config: Mapping[str, Any], stem: str) -> int:
    for name in (f"{stem}_index", f"{stem}_id"):
        if config.get(name) is not None:
            return config[name]
    raise ConfigError(f"config.json has no {stem}_index: it cannot serve Gemma 3 images")


def _per_channel(value: float | Sequence[float]) -> tuple[float, ...]:
    return (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)


def pan_and_scan_boxes(width: int, height: int, config: Gemma3ImageConfig) -> list[tuple[int, int, int, int]]:
    """(left, top, right, bottom) of each pan-and-scan crop of a width x height image, in reading order: an image
    whose long side is at least `min_ratio_to_activate` times its short one is cut along the long side into about
    long / short crops (2 to `max_num_crops`, none narrower than `min_crop_size`); otherwise none (transformers' rule,
    the last crop clipped at the edge)."""
    if not config.do_pan_and_scan:
        return []
    long, short = max(width, height), min(width, height)
    if long / short < config.pan_and_scan_min_ratio_to_activate:
        return []
    count = min(int(math.floor(long / short + 0.5)), int(math.floor(long / config.pan_and_scan_min_crop_size)))
    count = min(config.pan_and_scan_max_num_crops, max(2, count))
    across, down = (count, 1) if width >= height else (1, count)
    crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
    if min(crop_w, crop_h) < config.pan_and_scan_min_crop_size:
        return []
    boxes = [(x, y, min(x + crop_w, width), min(y + crop_h, height))
             for y in range(0, down * crop_h, crop_h) for x in range(0, across * crop_w, crop_w)]
    if any(left >= right or top >= bottom for left, top, right, bottom in boxes):
        # transformers fails on the empty crop too; a larger min_crop_size avoids it
        raise RequestError(f"pan-and-scan cuts an empty crop from a {width}x{height} image; raise "
                           "pan_and_scan_min_crop_size", param="mm_processor_kwargs")
    return boxes


def preprocess_image(image: Image.Image, config: Gemma3ImageConfig) -> torch.Tensor:
    """[1 + crops, 3, S, S] float32 pixels: the image, then its pan-and-scan crops (none unless enabled), each a PIL
    resize of the RGB pixels to S x S, then (x * rescale - mean) / std with the rescale in float64 and the rest in
    float32, as the processor computes them."""
    rgb = to_rgb(image)
    views = [rgb, *(rgb.crop(box) for box in pan_and_scan_boxes(rgb.width, rgb.height, config))]
    return torch.from_numpy(np.stack([_normalized(v, config) for v in views]))


def _normalized(image: Image.Image, config: Gemma3ImageConfig) -> np.ndarray:
    size = config.image_size
    pixels = np.array(image.resize((size, size), resample=config.resample), dtype=np.uint8)
    values = pixels.astype(np.float64) * config.rescale_factor if config.do_rescale else pixels
    values = values.astype(np.float32)
    if config.do_normalize:
        mean = np.array(config.image_mean, dtype=np.float32)
        std = np.array(config.image_std, dtype=np.float32)
        values = (values - mean) / std
    return np.ascontiguousarray(values.transpose(2, 0, 1))


@dataclass
class Gemma3ImageInputs:
    """The preprocessed images of one request, in prompt order (the `mm_inputs` of a Request)."""

    pixel_values: list[torch.Tensor]  # per image: [1 + pan-and-scan crops, 3, S, S]
    cache_key: bytes  # digest of the pixels: prompts with other images never share KV blocks past `first_position`
    first_position: int  # prompt position of the first image soft token
    # (start, end) prompt positions of the soft tokens of each image and each crop (a block of its own, as
    # transformers' token_type_ids groups them): a block's tokens attend to each other during prefill, so no prefill
    # chunk may end inside one.
    bidirectional_spans: tuple[tuple[int, int], ...]


class Gemma3ImagePromptProcessor:
    """Images -> pixels, and a rendered prompt's `<start_of_image>` -> the processor's full image sequence (with
    pan-and-scan, the processor's sentence around the sequences of the image and its crops)."""

    accepts_processor_kwargs = True

    def __init__(self, config: Gemma3ImageConfig, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        names = tokenizer.convert_ids_to_tokens([config.boi_token_id, config.image_token_id, config.eoi_token_id])
        self.boi, self.image_token, self.eoi = names
        # The tokenizer must know the three tokens by the ids config.json names, else images cannot be placed.
        self.usable = all(isinstance(n, str) and tokenizer.convert_tokens_to_ids(n) == i for n, i in
                          zip(names, (config.boi_token_id, config.image_token_id, config.eoi_token_id), strict=True))
        self.image_sequence = (f"\n\n{self.boi}{self.image_token * config.tokens_per_image}{self.eoi}\n\n"
                               if self.usable else None)

    @classmethod
    def for_model(cls, model: ModelConfig, tokenizer: Any, pre: Mapping[str, Any] | None
                  ) -> Gemma3ImagePromptProcessor:
        return cls(Gemma3ImageConfig.from_hf_config(model.hf_config.to_dict(), pre), tokenizer)

    @property
    def image_placeholder(self) -> str:
        return self.boi or "<start_of_image>"

    def process_text(self, text: str, images: list[Image.Image], mm_processor_kwargs: Mapping[str, Any] | None = None
                     ) -> tuple[list[int], Gemma3ImageInputs]:
        """Replace the i-th `<start_of_image>` of `text` by the i-th image's sequence, tokenize, preprocess;
        `mm_processor_kwargs` may set the pan-and-scan options for this request."""
        self._check_usable()
        config = self.config.with_kwargs(mm_processor_kwargs)
        pieces = text.split(self.boi)
        if len(pieces) - 1 != len(images):
            raise RequestError(f"the prompt has {len(pieces) - 1} {self.boi} placeholders but {len(images)} images",
                               param="messages")
        pixels = [preprocess_image(i, config) for i in images]
        expanded = [pieces[0]]
        for p, piece in zip(pixels, pieces[1:], strict=True):
            expanded += [self._replacement(p.shape[0] - 1), piece]
        ids = self.tokenizer("".join(expanded), add_special_tokens=False).input_ids
        return ids, self.inputs(ids, pixels)

    def _replacement(self, crops: int) -> str:
        """What stands for an image with `crops` pan-and-scan crops (Gemma3Processor.replace_image_token)."""
        if not crops:
            return self.image_sequence
        return (f"Here is the original image {self.image_sequence} and here are some crops to help you see better "
                + " ".join([self.image_sequence] * crops))

    def process(self, token_ids: list[int], images: list[Image.Image],
                mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], Gemma3ImageInputs]:
        """A tokenized prompt: its text is decoded back and expanded (the processor's tokens only if the ids are the
        tokenizer's own for that text)."""
        text = self.tokenizer.decode(token_ids, clean_up_tokenization_spaces=False)
        return self.process_text(text, images, mm_processor_kwargs)

    def inputs(self, ids: list[int], pixels: list[torch.Tensor]) -> Gemma3ImageInputs:
        """The request's inputs; its soft tokens must form one run of `tokens_per_image` per image and per crop."""
        digest = hashlib.blake2b(digest_size=16)
        for p in pixels:
            digest.update(np.asarray(p.shape, np.int64).tobytes())
            digest.update(p.numpy().tobytes())
        spans = image_token_runs(ids, self.config.image_token_id)
        per_image, blocks = self.config.tokens_per_image, sum(p.shape[0] for p in pixels)
        if len(spans) != blocks or any(e - s != per_image for s, e in spans):
            raise RequestError(f"the prompt's image soft tokens {spans} do not form one run of {per_image} per image "
                               f"and crop ({len(pixels)} images, {blocks - len(pixels)} crops)",
                               param="multi_modal_data")
        return Gemma3ImageInputs(pixels, digest.digest(), spans[0][0] if spans else 0, tuple(spans))

    def attach(self, token_ids: list[int], data: Any, mm_processor_kwargs: Mapping[str, Any] | None = None
               ) -> tuple[list[int], Gemma3ImageInputs | None]:
        """The engine's entry: `multi_modal_data` is Gemma3ImageInputs, or {"image": image or list of images}."""
        if isinstance(data, Gemma3ImageInputs):
            self.inputs(token_ids, data.pixel_values)  # checks the soft tokens against the images
            return token_ids, data
        images = images_of(data)
        return self.process(token_ids, images, mm_processor_kwargs) if images else (token_ids, None)

    def _check_usable(self) -> None:
        if not self.usable:
            raise RequestError("this checkpoint's tokenizer lacks the image tokens config.json names "
                               f"(ids {self.config.boi_token_id}, {self.config.image_token_id}, "
                               f"{self.config.eoi_token_id}): it serves text only", param="messages")


"""Gemma 3 image preprocessing (resize to the tower's square, rescale, normalize) and the prompt expansion of each
`<start_of_image>` into the image's soft tokens, both as transformers' Gemma3Processor does them."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from strata.config import ModelConfig
from strata.errors import ConfigError, RequestError
from strata.multimodal.image_loading import to_rgb


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

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], pre: Mapping[str, Any] | None) -> Gemma3ImageConfig:
        """From config.json and preprocessor_config.json (None: transformers' defaults)."""
        pre = pre or {}
        if pre.get("do_pan_and_scan"):
            raise ConfigError("preprocessor_config.json sets do_pan_and_scan: pan-and-scan crops are not supported "
                              "for Gemma 3 yet; set it to false or null")
        if pre.get("do_resize") is False:
            raise ConfigError("preprocessor_config.json sets do_resize false: Gemma 3's tower takes "
                              "vision_config.image_size squares only")
        vision = config["vision_config"]
        size = pre.get("size") or {}
        if size and (size.get("height") != vision["image_size"] or size.get("width") != vision["image_size"]):
            raise ConfigError(f"preprocessor_config.json resizes to {size}, but the vision tower takes "
                              f"{vision['image_size']}x{vision['image_size']} images")
        defaults = cls(0, 0, 0, 0, 0)
        return cls(image_size=int(vision["image_size"]), tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
                   image_token_id=int(_first(config, "image_token")), boi_token_id=int(_first(config, "boi_token")),
                   eoi_token_id=int(_first(config, "eoi_token")),
                   resample=int(pre.get("resample") if pre.get("resample") is not None else defaults.resample),
                   do_rescale=bool(pre.get("do_rescale", True)),
                   rescale_factor=float(pre.get("rescale_factor") or defaults.rescale_factor),
                   do_normalize=bool(pre.get("do_normalize", True)),
                   image_mean=_per_channel(pre.get("image_mean") or defaults.image_mean),
                   image_std=_per_channel(pre.get("image_std") or defaults.image_std))


def _first(config: Mapping[str, Any], stem: str) -> int:
    for name in (f"{stem}_index", f"{stem}_id"):
        if config.get(name) is not None:
            return config[name]
    raise ConfigError(f"config.json has no {stem}_index: it cannot serve Gemma 3 images")


def _per_channel(value: float | Sequence[float]) -> tuple[float, ...]:
    return (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)


def preprocess_image(image: Image.Image, config: Gemma3ImageConfig) -> torch.Tensor:
    """[1, 3, S, S] float32 pixels: a PIL resize of the RGB image to S x S, then (x * rescale - mean) / std with
    the rescale in float64 and the rest in float32, as the processor computes them."""
    size = config.image_size
    pixels = np.array(to_rgb(image).resize((size, size), resample=config.resample), dtype=np.uint8)
    values = pixels.astype(np.float64) * config.rescale_factor if config.do_rescale else pixels
    values = values.astype(np.float32)
    if config.do_normalize:
        mean = np.array(config.image_mean, dtype=np.float32)
        std = np.array(config.image_std, dtype=np.float32)
        values = (values - mean) / std
    return torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))[None]


@dataclass
class Gemma3ImageInputs:
    """The preprocessed images of one request, in prompt order (the `mm_inputs` of a Request)."""

    pixel_values: list[torch.Tensor]  # per image: [1, 3, S, S]
    cache_key: bytes  # digest of the pixels: prompts with other images never share KV blocks past `first_position`
    first_position: int  # prompt position of the first image soft token
    # (start, end) prompt positions of each image's soft tokens: they attend to each other during prefill, so no
    # prefill chunk may end inside one.
    bidirectional_spans: tuple[tuple[int, int], ...]


class Gemma3ImagePromptProcessor:
    """Images -> pixels, and a rendered prompt's `<start_of_image>` -> the processor's full image sequence."""

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

    def process_text(self, text: str, images: list[Image.Image], add_special_tokens: bool = False
                     ) -> tuple[list[int], Gemma3ImageInputs]:
        """Replace the i-th `<start_of_image>` of `text` by the i-th image's sequence, tokenize, preprocess."""
        self._check_usable()
        found = text.count(self.boi)
        if found != len(images):
            raise RequestError(f"the prompt has {found} {self.boi} placeholders but {len(images)} images",
                               param="messages")
        ids = self.tokenizer(text.replace(self.boi, self.image_sequence),
                             add_special_tokens=add_special_tokens).input_ids
        return ids, self.inputs(ids, [preprocess_image(i, self.config) for i in images])

    def process(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], Gemma3ImageInputs]:
        """A tokenized prompt: its text is decoded back and expanded (the processor's tokens only if the ids are the
        tokenizer's own for that text)."""
        return self.process_text(self.tokenizer.decode(token_ids, clean_up_tokenization_spaces=False), images)

    def inputs(self, ids: list[int], pixels: list[torch.Tensor]) -> Gemma3ImageInputs:
        digest = hashlib.blake2b(digest_size=16)
        for p in pixels:
            digest.update(p.numpy().tobytes())
        spans = image_spans(ids, self.config.image_token_id)
        per_image = self.config.tokens_per_image
        if len(spans) != len(pixels) or any(e - s != per_image for s, e in spans):
            raise RequestError(f"the prompt's image soft tokens {spans} do not form one run of {per_image} per image "
                               f"({len(pixels)} images)", param="multi_modal_data")
        return Gemma3ImageInputs(pixels, digest.digest(), spans[0][0] if spans else 0, tuple(spans))

    def attach(self, token_ids: list[int], data: Any) -> tuple[list[int], Gemma3ImageInputs | None]:
        """The engine's entry: `multi_modal_data` is Gemma3ImageInputs, or {"image": image or list of images}."""
        if isinstance(data, Gemma3ImageInputs):
            self.inputs(token_ids, data.pixel_values)  # checks the soft tokens against the images
            return token_ids, data
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise RequestError("multi_modal_data must be {'image': <PIL image or list of them>}",
                               param="multi_modal_data")
        images = data.get("image")
        images = [] if images is None else images if isinstance(images, (list, tuple)) else [images]
        if not images:
            return token_ids, None
        if not all(isinstance(i, Image.Image) for i in images):
            raise RequestError("multi_modal_data['image'] must hold PIL images", param="multi_modal_data")
        return self.process(token_ids, [to_rgb(i) for i in images])

    def _check_usable(self) -> None:
        if not self.usable:
            raise RequestError("this checkpoint's tokenizer lacks the image tokens config.json names "
                               f"(ids {self.config.boi_token_id}, {self.config.image_token_id}, "
                               f"{self.config.eoi_token_id}): it serves text only", param="messages")


def image_spans(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of image soft tokens (transformers' image blocks)."""
    spans, start = [], None
    for i, t in enumerate([*token_ids, -1]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            spans.append((start, i))
            start = None
    return spans

"""Chat messages with images -> prompt text, token ids with expanded image placeholders, and the
preprocessed images (`ImageInputs`) that travel with the request; shared by `LLM.chat` and the server."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from strata.config import ModelConfig
from strata.config.multimodal_config import MultiModalConfig
from strata.errors import RequestError, UnsupportedModelError
from strata.multimodal.gemma3_image import Gemma3ImagePromptProcessor
from strata.multimodal.image_cache import ImageCache
from strata.multimodal.image_loading import images_of, load_image, to_rgb
from strata.multimodal.llama4_image import (
    IMAGE,
    Llama4ImageConfig,
    expand_image_placeholders,
    num_image_features,
    placeholder_token_ids,
    preprocess_image,
)
from strata.multimodal.qwen2_vl_image import Qwen2VLImagePromptProcessor
from strata.tokenizer import apply_chat_template

TEXT_PARTS = {"text", "input_text"}
IMAGE_PARTS = {"image_url", "input_image", "image"}
_UNSUPPORTED_PARTS = {"video_url": "video", "video": "video", "input_video": "video", "audio_url": "audio",
                      "input_audio": "audio", "audio": "audio"}
# A template that loops over a message's content renders content parts ({"type": "image"} included);
# one that prints `message['content']` as a whole needs a string with the image placeholder in it.
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content)")


@dataclass
class ImageInputs:
    """The preprocessed images of one request, in prompt order (the `mm_inputs` of a Request)."""

    pixel_values: list[torch.Tensor]  # per image: [tiles, 3, tile, tile]
    aspect_ratios: list[tuple[int, int]]
    cache_key: bytes  # digest of the pixels: prompts with other images never share KV blocks past `first_position`
    first_position: int  # prompt position of the first image-feature token
    bidirectional_spans: tuple[tuple[int, int], ...] = ()  # Llama 4's image tokens attend causally


@dataclass
class ChatPrompt:
    text: str  # the rendered conversation, one image placeholder per image
    token_ids: list[int]  # placeholders expanded into the image's tokens
    mm_inputs: ImageInputs | None


class ImagePromptProcessor:
    """Turns images into tiles and a prompt's `<|image|>` tokens into the tokens the model fills (Llama 4)."""

    def __init__(self, image_config: Llama4ImageConfig, tokenizer: Any) -> None:
        self.config, self.tokenizer = image_config, tokenizer
        self.token_ids = placeholder_token_ids(tokenizer)
        patch = self.token_ids["<|patch|>"]
        if patch != image_config.image_token_id:
            raise UnsupportedModelError(f"the tokenizer's <|patch|> is id {patch} but config.json says "
                                        f"image_token_index={image_config.image_token_id}", param="model")

    @classmethod
    def for_model(cls, model: ModelConfig, tokenizer: Any) -> ImagePromptProcessor | Gemma3ImagePromptProcessor | None:
        """The processor of a multimodal checkpoint; None for text-only models."""
        if not model.info.is_multimodal:
            return None
        pre = _preprocessor_config(Path(model.path))
        if model.architecture == "Gemma3ForConditionalGeneration":
            return Gemma3ImagePromptProcessor.for_model(model, tokenizer, pre)
        if model.architecture == "Qwen2_5_VLForConditionalGeneration":
            return Qwen2VLImagePromptProcessor.for_model(model, tokenizer, pre)
        if model.architecture != "Llama4ForConditionalGeneration":
            raise UnsupportedModelError(f"no image processor for {model.architecture}", param="model")
        return cls(Llama4ImageConfig.from_hf_config(model.hf_config.to_dict(), pre), tokenizer)

    @property
    def image_placeholder(self) -> str:
        return IMAGE

    def process(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], ImageInputs]:
        """Expand the i-th `<|image|>` of `token_ids` for the i-th image and tile the images."""
        tiles, ratios = [], []
        for image in images:
            pixels, ratio = preprocess_image(image, self.config)
            tiles.append(pixels)
            ratios.append(ratio)
        ids = expand_image_placeholders(token_ids, ratios, self.config.tokens_per_tile, self.token_ids)
        return ids, self._inputs(ids, tiles, ratios)

    def process_text(self, text: str, images: list[Image.Image]) -> tuple[list[int], ImageInputs]:
        """A rendered conversation: tokenized as it is, then its placeholder ids expanded."""
        return self.process(self.tokenizer(text, add_special_tokens=False).input_ids, images)

    def check(self, token_ids: list[int], inputs: ImageInputs) -> None:
        """Already expanded prompts (from `render_chat`) must have one feature token per image feature."""
        expected = sum(num_image_features(r, self.config.tokens_per_tile) for r in inputs.aspect_ratios)
        found = sum(1 for t in token_ids if t == self.config.image_token_id)
        if found != expected:
            raise RequestError(f"the prompt has {found} image-feature tokens but its images need {expected}",
                               param="multi_modal_data")

    def _inputs(self, ids: list[int], tiles: list[torch.Tensor], ratios: list[tuple[int, int]]) -> ImageInputs:
        digest = hashlib.blake2b(digest_size=16)
        for pixels in tiles:
            digest.update(pixels.contiguous().view(torch.int16).numpy().tobytes())
        return ImageInputs(tiles, ratios, digest.digest(), ids.index(self.config.image_token_id))

    def attach(self, token_ids: list[int], data: Any) -> tuple[list[int], ImageInputs | None]:
        """The engine's entry: `multi_modal_data` is ImageInputs, or {"image": image or list of images}."""
        if isinstance(data, ImageInputs):
            self.check(token_ids, data)
            return token_ids, data
        images = images_of(data)
        return self.process(token_ids, images) if images else (token_ids, None)


def _preprocessor_config(folder: Path) -> dict[str, Any] | None:
    """preprocessor_config.json, or the `image_processor` entry of processor_config.json (transformers 5 saves
    processors that way); None when the checkpoint has neither."""
    path = folder / "preprocessor_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    path = folder / "processor_config.json"
    return json.loads(path.read_text()).get("image_processor") if path.is_file() else None


def template_renders_parts(chat_template: Any) -> bool:
    return isinstance(chat_template, str) and bool(_ITERATES_CONTENT.search(chat_template))


def parse_message_content(messages: list[dict[str, Any]], parts_format: bool, multimodal: bool,
                          image_placeholder: str = IMAGE) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages as the chat template gets them, and the image references in order of appearance.

    Images become `{"type": "image"}` parts for templates that render parts, else `image_placeholder`
    inside the text (parts joined by newlines). Image references are URL strings (or PIL images).
    """
    parsed, images = [], []
    for i, message in enumerate(messages):
        entry = dict(message)
        content = message.get("content")
        if content is None:
            entry["content"] = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in TEXT_PARTS:
                    parts.append({"type": "text", "text": part.get("text") or ""})
                elif kind in IMAGE_PARTS:
                    if not multimodal:
                        raise RequestError(f"{where} is an image, but this model is text-only and cannot read "
                                           "images; send text content only", param=where)
                    images.append(_image_reference(part, where))
                    parts.append({"type": "image"})
                elif kind in _UNSUPPORTED_PARTS:
                    raise RequestError(f"{where} is a {kind} part: {_UNSUPPORTED_PARTS[kind]} inputs are not "
                                       "supported (strata takes text and images)", param=where)
                else:
                    raise RequestError(f"{where} has unsupported content type {kind!r} (supported: text, "
                                       "image_url)", param=where)
            entry["content"] = parts if parts_format else "\n".join(
                p["text"] if p["type"] == "text" else image_placeholder for p in parts)
        parsed.append(entry)
    return parsed, images


def check_image_count(count: int, mm_config: MultiModalConfig) -> None:
    """Refuse a prompt with more images than limit_mm_per_prompt allows, before any is loaded."""
    if mm_config.image_limit is not None and count > mm_config.image_limit:
        raise RequestError(f"the prompt has {count} images, over this server's limit of {mm_config.image_limit} "
                           "per prompt (limit_mm_per_prompt)", param="messages")


def _image_reference(part: dict[str, Any], where: str) -> Any:
    value = part.get("image_url", part.get("image"))
    if isinstance(value, dict):
        value = value.get("url")
    if isinstance(value, Image.Image) or (isinstance(value, str) and value.strip()):
        return value
    raise RequestError(f"{where} has no image URL (expected {{'image_url': {{'url': ...}}}})", param=where)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                processor: ImagePromptProcessor | Gemma3ImagePromptProcessor | None,
                chat_template: str | None = None, add_generation_prompt: bool = True, *,
                allowed_local_media_path: str | None = None, allow_remote_media: bool = False,
                mm_config: MultiModalConfig | None = None, image_cache: ImageCache | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None, **template_kwargs: Any) -> ChatPrompt:
    """Render one conversation; images in its messages are loaded (within `mm_config`'s limits, through
    `image_cache`), tiled and expanded into the ids."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    placeholder = processor.image_placeholder if processor is not None else IMAGE
    parsed, refs = parse_message_content(messages, template_renders_parts(template), processor is not None,
                                         placeholder)
    if mm_processor_kwargs and not getattr(processor, "accepts_processor_kwargs", False):
        # refused with or without images: the model's processor (if any) takes no per-request options
        raise RequestError("mm_processor_kwargs is not supported for this model", param="mm_processor_kwargs")
    text = apply_chat_template(tokenizer, parsed, chat_template, add_generation_prompt, **template_kwargs)
    if not refs:
        return ChatPrompt(text, tokenizer(text, add_special_tokens=False).input_ids, None)
    mm_config = mm_config or MultiModalConfig()
    check_image_count(len(refs), mm_config)
    images = [to_rgb(r) if isinstance(r, Image.Image) else
              load_image(r, allowed_local_media_path=allowed_local_media_path, allow_remote_media=allow_remote_media,
                         max_pixels=mm_config.max_image_pixels, cache=image_cache)
              for r in refs]
    ids, inputs = (processor.process_text(text, images, mm_processor_kwargs) if mm_processor_kwargs
                   else processor.process_text(text, images))
    return ChatPrompt(text, ids, inputs)

"""Input processing: a prompt tokenized (or a conversation rendered), its images attached and validated into a
ProcessedPrompt, then made a CoreRequest (n > 1 fanned out into samples). Needs no scheduler or executor: the
server and LLM call it in their own threads, so a bad prompt fails before anything is queued."""
from __future__ import annotations

import time
from typing import Any

from strata.config import EngineConfig
from strata.engine.request import CoreRequest, ProcessedPrompt
from strata.errors import RequestError
from strata.lora.request import LoRARequest
from strata.multimodal.chat import ImagePromptProcessor, check_image_count, render_chat
from strata.multimodal.image_cache import ImageCache
from strata.reasoning import reasoning_parser
from strata.sampling_params import SamplingParams
from strata.tokenizer import load_tokenizer

PromptInput = str | list[int] | dict[str, Any]


def fan_out(request_id: str, params: SamplingParams) -> tuple[tuple[str, SamplingParams], ...]:
    """One scheduler request per sample: n == 1 keeps the request's id; n > 1 gives `id#i`, and a seeded request
    seed + i, so that the samples differ and each is reproducible."""
    if params.n == 1:
        return ((request_id, params),)
    return tuple((f"{request_id}#{i}", params.clone(n=1, seed=None if params.seed is None else params.seed + i))
                 for i in range(params.n))


def _image_count(mm: Any) -> int:
    """Images in `multi_modal_data`: {"image": one or a list}, or already processed inputs."""
    images = mm.get("image") if isinstance(mm, dict) else getattr(mm, "pixel_values", None)
    return len(images) if isinstance(images, (list, tuple)) else int(images is not None)


class InputProcessor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.tokenizer_gguf_file)
        self.reasoning = reasoning_parser(config.structured.reasoning_parser, self.tokenizer)
        self.mm_processor = ImagePromptProcessor.for_model(config.model, self.tokenizer)
        cache_bytes = config.multimodal.cache_bytes
        self.image_cache = ImageCache(cache_bytes) if self.mm_processor is not None and cache_bytes else None
        self.stop_token_ids = set(config.model.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.stop_token_ids.add(self.tokenizer.eos_token_id)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def accepts_images(self) -> bool:
        return self.mm_processor is not None

    def process_prompt(self, prompt: PromptInput | ProcessedPrompt, truncate_prompt_tokens: int | None = None,
                       truncation_side: str = "left") -> ProcessedPrompt:
        """Tokenize, attach images and validate: the one place a prompt is checked on its way in.
        `truncate_prompt_tokens` keeps that many tokens (-1: the context length) from `truncation_side`'s
        opposite end, as vLLM's completions do; the text of a truncated prompt is dropped."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text, token_ids, mm = self._tokenize(prompt)
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            token_ids = (token_ids[:keep] if truncation_side == "right"
                         else token_ids[len(token_ids) - min(keep, len(token_ids)):])
            text = None
        if mm is not None:
            if self.mm_processor is None:
                raise RequestError("this model is text-only and cannot take multi_modal_data",
                                   param="multi_modal_data")
            check_image_count(_image_count(mm), self.config.multimodal)
            kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
            if kwargs and not getattr(self.mm_processor, "accepts_processor_kwargs", False):
                raise RequestError("mm_processor_kwargs is not supported for this model", param="mm_processor_kwargs")
            token_ids, mm = (self.mm_processor.attach(token_ids, mm, kwargs) if kwargs
                             else self.mm_processor.attach(token_ids, mm))
        return self._validated(ProcessedPrompt(text, token_ids, mm))

    def render_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, *, template_kwargs: dict[str, Any] | None = None,
                    allowed_local_media_path: str | None = None, allow_remote_media: bool = False,
                    validate: bool = True, mm_processor_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
        """One conversation through the chat template (the configured one unless given), its images loaded,
        tiled and expanded into placeholder ids; validated like any prompt unless `validate` is False (for
        /tokenize, which counts the tokens of any conversation)."""
        chat = render_chat(self.tokenizer, messages, self.mm_processor, chat_template or self.config.chat_template,
                           add_generation_prompt, allowed_local_media_path=allowed_local_media_path,
                           allow_remote_media=allow_remote_media, mm_config=self.config.multimodal,
                           image_cache=self.image_cache, mm_processor_kwargs=mm_processor_kwargs,
                           **(template_kwargs or {}))
        prompt = ProcessedPrompt(chat.text, chat.token_ids, chat.mm_inputs, template_kwargs)
        return self._validated(prompt) if validate else prompt

    def make_request(self, request_id: str, prompt: PromptInput | ProcessedPrompt, params: SamplingParams,
                     arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> CoreRequest:
        """The request as the core and the output side take it; a raw prompt is processed here."""
        prompt = self.process_prompt(prompt)
        params = params.clone()
        params.all_stop_token_ids = set(self.stop_token_ids)
        # A thinking output is constrained from the end of its thinking on.
        thinking = (params.structured_outputs is not None and self.reasoning is not None
                    and self.reasoning.thinks_first(prompt.token_ids, prompt.chat_template_kwargs))
        return CoreRequest(request_id, prompt, params, fan_out(request_id, params),
                           time.monotonic() if arrival_time is None else arrival_time, thinking, lora_request)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int], Any]:
        mm = None
        if isinstance(prompt, dict):
            mm = prompt.get("multi_modal_data")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), mm
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids, mm
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), mm
        raise RequestError("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                           "'prompt_token_ids'", param="prompt")

    def _validated(self, prompt: ProcessedPrompt) -> ProcessedPrompt:
        token_ids = prompt.token_ids
        if not token_ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(token_ids)} tokens (at least one token must be left to generate)", param="prompt")
        vocab = self.config.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        return prompt

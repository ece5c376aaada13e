"""The offline API: LLM(...).generate(...) and LLM.chat(...)."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from strata.config import EngineConfig
from strata.engine.engine import Engine, PromptInput
from strata.engine.request import ProcessedPrompt
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams
from strata.tokenizer import read_chat_template

logger = logging.getLogger(__name__)


class LLM:
    """Loads a checkpoint once and generates for batches of prompts with continuous batching."""

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, quantization: str | None = None, seed: int = 0,
                 device: str = "auto", enable_prefix_caching: bool | None = None,
                 chat_template: str | None = None, allowed_local_media_path: str | None = None,
                 allow_remote_media: bool = False, **kwargs: Any) -> None:
        config = EngineConfig.create(
            model, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization, quantization=quantization, seed=seed, device=device,
            enable_prefix_caching=enable_prefix_caching, chat_template=read_chat_template(chat_template),
            **kwargs)
        self.engine = Engine(config)
        self.media_options = {"allowed_local_media_path": allowed_local_media_path,
                              "allow_remote_media": allow_remote_media}
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | ProcessedPrompt | Sequence[PromptInput | ProcessedPrompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
        return [finals[i] for i in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = read_chat_template(chat_template)
        # Image parts ({"type": "image_url", ...}) are loaded, tiled and expanded into placeholder ids.
        prompts = [self.engine.render_chat(conversation, template, add_generation_prompt, **self.media_options)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

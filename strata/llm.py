"""The offline API: LLM(...).generate(...) and LLM.chat(...)."""
from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from strata.config import EngineConfig
from strata.config.engine_args import EngineArgs
from strata.engine.engine import Engine, PromptInput
from strata.engine.pooling_engine import PoolingEngine
from strata.engine.request import ProcessedPrompt
from strata.errors import RequestError
from strata.executor.spawn_guard import refuse_engine_in_spawn_bootstrap
from strata.lora.request import LoRARequest
from strata.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from strata.sampling_params import SamplingParams
from strata.tokenizer import chat_template_keywords, read_chat_template

logger = logging.getLogger(__name__)


class LLM:
    """Loads a checkpoint once and generates for batches of prompts with continuous batching."""

    def __init__(self, model: str, *, chat_template: str | None = None, allowed_local_media_path: str | None = None,
                 allow_remote_media: bool = False, served_model_name: str | list[str] | None = None,
                 **engine_options: Any) -> None:
        """`engine_options` are EngineArgs' fields (tensor_parallel_size=..., dtype=..., kv_cache_memory=...);
        a misspelt one is refused naming the close matches."""
        args = EngineArgs.from_kwargs(model, engine_options, "LLM", _own_keywords())
        config = EngineConfig.from_args(args, served_model_name=served_model_name,
                                        chat_template=read_chat_template(chat_template))
        if config.parallel.world_size > 1:  # before seconds of tokenizer loading in a worker that re-ran a script
            refuse_engine_in_spawn_bootstrap()
        self.runner = config.runner
        self.engine = PoolingEngine(config) if config.runner == "pooling" else Engine(config)
        self.media_options = {"allowed_local_media_path": allowed_local_media_path,
                              "allow_remote_media": allow_remote_media}
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer if self.runner == "pooling" else self.engine.input.tokenizer

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], *, truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), pooled as the checkpoint's sentence-transformers config
        says; `dimensions` truncates (Matryoshka models only), `truncate_prompt_tokens` cuts long inputs."""
        if self.runner != "pooling":
            raise RequestError("LLM.embed needs an embedding model: this one was loaded to generate text. Load it "
                               "with runner='pooling' (an encoder such as BertModel, or a decoder such as "
                               "Qwen3-Embedding, which convert='embed' also turns into one)", param="runner")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        result = self.engine.embed(list(prompts), truncate_prompt_tokens, dimensions)
        return [EmbeddingRequestOutput(str(next(self._ids)), ids, EmbeddingOutput(vector.tolist()))
                for ids, vector in zip(result.prompt_token_ids, result.embeddings, strict=True)]

    def classify(self, prompts: str | list[int] | Sequence[str | list[int]], *,
                 truncate_prompt_tokens: int | None = None, use_activation: bool = True,
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt from a sequence classifier (softmax, or sigmoid for one label, as vLLM
        applies them; the logits with use_activation=False)."""
        self._require_pooling("LLM.classify", "a sequence classifier (e.g. BertForSequenceClassification)")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        result = self.engine.classify(list(prompts), truncate_prompt_tokens, use_activation)
        return [ClassificationRequestOutput(str(next(self._ids)), ids, ClassificationOutput(probs.tolist()))
                for ids, probs in zip(result.prompt_token_ids, result.probs, strict=True)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_activation: bool = True) -> list[ScoringRequestOutput]:
        """One score per pair (1:1, 1:N or N:N): a cross-encoder's relevance of text_2 to text_1, or an embedding
        model's cosine similarity of the two."""
        self._require_pooling("LLM.score", "a cross-encoder (e.g. BertForSequenceClassification) or an embedding "
                              "model")
        result = self.engine.score(text_1 if isinstance(text_1, str) else list(text_1),
                                   text_2 if isinstance(text_2, str) else list(text_2), truncate_prompt_tokens,
                                   use_activation)
        return [ScoringRequestOutput(str(next(self._ids)), ids, ScoringOutput(score))
                for ids, score in zip(result.prompt_token_ids, result.scores, strict=True)]

    def _require_pooling(self, method: str, model: str) -> None:
        if self.runner != "pooling":
            raise RequestError(f"{method} needs {model}: this one was loaded to generate text. Load such a model "
                               "(runner='pooling', the default for encoders)", param="runner")

    def generate(self, prompts: PromptInput | ProcessedPrompt | Sequence[PromptInput | ProcessedPrompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter of every prompt, or a list of one per prompt (None: the base model);
        needs enable_lora."""
        if self.runner == "pooling":
            raise RequestError("this model is a pooling model (runner='pooling'): call LLM.embed(...) (or "
                               "LLM.classify / LLM.score for a cross-encoder) instead of generate / chat",
                               param="runner")
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p, lora_request=lora)
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
                failures = self.engine.take_failures()
                if failures:
                    for request_id in ids:
                        self.engine.abort_request(request_id)
                    raise failures[0][1]
        return [finals[i] for i in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """`tools`: OpenAI function tools, handed to the chat template (`tools=` of apply_chat_template).
        `mm_processor_kwargs`: the image processor's per-request options (Qwen2.5-VL: min_pixels, max_pixels;
        Gemma 3: do_pan_and_scan and the pan_and_scan_* options).
        `chat_template_kwargs`: more keywords for the template (e.g. {"enable_thinking": False}).
        `continue_final_message`: the last (assistant) message is continued instead of a new one started."""
        if self.runner == "pooling":
            return self.generate([], sampling_params)  # refused there, naming LLM.embed
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = read_chat_template(chat_template)
        add_generation_prompt, template_kwargs = chat_template_keywords(
            chat_template_kwargs, add_generation_prompt, continue_final_message, tools=tools or None)
        # Image parts ({"type": "image_url", ...}) are loaded, tiled and expanded into placeholder ids.
        prompts = [self.engine.input.render_chat(conversation, template, add_generation_prompt,
                                                 template_kwargs=template_kwargs, **self.media_options,
                                                 mm_processor_kwargs=mm_processor_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _own_keywords() -> list[str]:
    """LLM's keywords that are not engine options, suggested too when a keyword is misspelt."""
    return [p.name for p in inspect.signature(LLM.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]

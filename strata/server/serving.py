"""What completions and chat share: model-name checks, sampling parameters, engine streams, SSE and logprobs."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel

from strata.engine.async_engine import AsyncEngine
from strata.engine.request import ProcessedPrompt
from strata.errors import EngineDeadError, RequestError, StrataError
from strata.outputs import Logprob, PositionLogprobs, RequestOutput
from strata.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from strata.server.metrics import ServerMetrics
from strata.server.protocol import (
    ChatLogprobContent,
    ChatLogprobs,
    CompletionLogProbs,
    LogprobEntry,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    error_body,
)
from strata.server.serving_models import ServingModels
from strata.server.structured import request_constraint

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# JSON has no -inf; vLLM sends this floor instead.
_LOGPROB_FLOOR = -9999.0

Disconnected = Callable[[], Awaitable[None]]


class Serving:
    """Base of the completions and chat handlers: one engine, its served names and its metrics."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, log_requests: bool = True,
                 models: ServingModels | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_requests = log_requests
        self.models = models or ServingModels(engine)  # the base model's served names and the LoRA adapters
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}

    def check_model(self, name: str | None) -> str:
        """The served name to answer with; a missing or empty `model` means the first served name."""
        return self.models.check_model(name)

    def check_common(self, req: SamplingFields) -> None:
        if self.engine.is_dead:
            raise EngineDeadError(f"the engine is dead: {self.engine.dead_error}")
        if req.model_extra:  # as vLLM: routers and SDKs add fields of their own
            logger.debug("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))
        max_n = self.engine.config.scheduler.max_num_seqs
        if req.n > max_n:
            raise RequestError(f"n={req.n} is more than the server runs at once (--max-num-seqs {max_n})",
                               param="n")
        if req.stream_options is not None and not req.stream:
            raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise RequestError("prompt_logprobs is not available when streaming", param="prompt_logprobs")
        if req.logit_bias:
            raise RequestError("logit_bias is not supported", param="logit_bias")

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}", param=param)

    def sampling_params(self, req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None, structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=req.n, temperature=given(req.temperature, 1.0), top_p=given(req.top_p, 1.0),
            top_k=given(req.top_k, -1), min_p=given(req.min_p, 0.0), seed=req.seed, max_tokens=max_tokens,
            # min_tokens above max_tokens stops at max_tokens: JSON Schema cannot compare two fields for /openapi.json.
            min_tokens=req.min_tokens if max_tokens is None else min(req.min_tokens, max_tokens),
            stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=given(req.presence_penalty, 0.0), frequency_penalty=given(req.frequency_penalty, 0.0),
            repetition_penalty=given(req.repetition_penalty, 1.0), skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured_outputs or request_constraint(req.response_format, req.structured_outputs))

    def open_stream(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    arrival: float, model: str | None = None) -> AsyncIterator[RequestOutput]:
        """The engine's stream of one prompt for the served name `model` (a LoRA adapter's runs with it),
        processed (tokenized and validated) before the response starts, so a bad prompt is a 400 even for a
        streamed request."""
        lora = None if model is None else self.models.lora_request(model)
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s%s", request_id, len(prompt.token_ids), params,
                        "" if lora is None else f", LoRA adapter {lora.lora_name!r}")
        stream = self.engine.generate(request_id, prompt, params, lora_request=lora)
        return self.metrics.track(_engine_failures_as_500(stream), arrival)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def label(self, token_id: int, lp: Logprob | None = None, as_ids: bool = False) -> str:
        """A token's name in logprobs: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids, which
        keeps tokens apart whose partial UTF-8 bytes all decode to the same replacement character)."""
        if as_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.token_text(token_id)

    def completion_logprobs(self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None],
                            k: int, offset: int = 0, as_ids: bool = False) -> tuple[CompletionLogProbs, int]:
        """OpenAI's legacy shape (each top dict: the top k plus the chosen token, so k or k+1 entries), and the
        text offset after the last token (offsets add up token texts, so a stream continues from there)."""
        out = CompletionLogProbs()
        for token_id, position in zip(token_ids, positions, strict=True):
            chosen = position.get(token_id) if position else None
            out.tokens.append(self.label(token_id, chosen, as_ids))
            out.text_offset.append(offset)
            offset += len(self.label(token_id, chosen))
            if chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(safe_logprob(chosen.logprob))
            top: dict[str, float] = {}
            for tid, lp in _by_rank(position):
                if tid == token_id or _rank(lp) <= k:
                    top.setdefault(self.label(tid, lp, as_ids), safe_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return out, offset

    def chat_logprobs(self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int,
                      as_ids: bool = False) -> ChatLogprobs:
        """Chat's shape: exactly the top k alternatives per token (the chosen one only if it ranks)."""
        content = []
        for token_id, position in zip(token_ids, positions, strict=True):
            chosen = position.get(token_id)
            top = [_top_logprob(self.label(tid, lp, as_ids), lp.logprob)
                   for tid, lp in _by_rank(position) if _rank(lp) <= k][:k]
            logprob = chosen.logprob if chosen is not None else float("-inf")
            entry = _top_logprob(self.label(token_id, chosen, as_ids), logprob)
            content.append(ChatLogprobContent(**entry.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def prompt_logprobs(self, out: RequestOutput, k: int | None) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: entry}."""
        if k is None or out.prompt_logprobs is None:
            return None
        result: PromptLogprobs = []
        for token_id, position in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            if position is None:
                result.append(None)
                continue
            result.append({tid: LogprobEntry(logprob=safe_logprob(lp.logprob), rank=lp.rank,
                                             decoded_token=self.label(tid, lp))
                           for tid, lp in _by_rank(position) if tid == token_id or _rank(lp) <= k})
        return result


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def safe_logprob(value: float) -> float:
    return value if value >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN to the floor


def _rank(lp: Logprob) -> int:
    return lp.rank if lp.rank is not None else 1 << 30


def _by_rank(position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: _rank(item[1]))


def _top_logprob(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=safe_logprob(logprob), bytes=list(text.encode("utf-8")))


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def sse_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Headers are gone once streaming starts, so a failure becomes an error chunk; `[DONE]` always ends."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # noqa: BLE001 - every failure must reach the client as an error chunk
        if not isinstance(e, StrataError) or e.http_status >= 500:
            logger.exception("streamed request failed")
        yield f"data: {error_body(e)[1].model_dump_json()}\n\n"
    yield SSE_DONE


async def _engine_failures_as_500(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    # The engine dying under a running request is an internal error of that request (500); only
    # requests arriving at a dead engine get 503.
    try:
        async for out in stream:
            yield out
    except EngineDeadError as e:
        raise StrataError(f"Internal server error: {e.message}") from e


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as (stream index, output); leaving early aborts them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(streams: list[AsyncIterator[RequestOutput]], disconnected: Disconnected | None
                        ) -> list[RequestOutput] | None:
    """The last output of every stream, or None if the client went away first (the requests are aborted)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def consume() -> None:
        async for i, out in merge_streams(streams):
            finals[i] = out

    work = asyncio.create_task(consume())
    watcher = asyncio.create_task(disconnected()) if disconnected is not None else None
    try:
        await asyncio.wait({work} | ({watcher} if watcher else set()), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if watcher is not None:
            watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        logger.info("client disconnected; its requests were aborted")
        return None
    work.result()  # re-raises a failure
    return finals  # type: ignore[return-value]

"""POST /v1/chat/completions: messages -> chat template -> engine -> a response or an SSE stream. With a reasoning
parser the thinking goes to `reasoning_content` and the answer after it to content and tool calls."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from strata.engine.request import ProcessedPrompt
from strata.errors import RequestError
from strata.outputs import CompletionOutput, RequestOutput
from strata.sampling_params import SamplingParams
from strata.server.contract import rendered_roles
from strata.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    random_id,
)
from strata.server.serving import (
    Disconnected,
    Serving,
    final_outputs,
    merge_streams,
    sse,
    sse_with_errors,
    usage,
)
from strata.server.tool_parsers import ParsedCall, tool_call_markers
from strata.server.tools import ToolPlan, plan_tools, template_messages
from strata.tokenizer import apply_chat_template, chat_template_keywords, drops_special_markers


@dataclass
class _ChatJob:
    request_id: str
    model: str
    prompt: ProcessedPrompt
    params: SamplingParams
    req: ChatCompletionRequest
    tools: ToolPlan
    thinks_first: bool | None = None  # whether the output starts with thinking; None without a reasoning parser


class ChatServing(Serving):
    def __init__(self, *args: Any, chat_template: str | None = None, allowed_local_media_path: str | None = None,
                 allow_remote_media: bool = False, tool_call_parser: str | None = None, **kwargs: Any) -> None:
        """`tool_call_parser`: the parser of `tool_choice="auto"` (None: auto is refused)."""
        super().__init__(*args, **kwargs)
        self.tool_call_parser = tool_call_parser
        self.reasoning = self.engine.reasoning
        # Parsers read the detokenized text, from which skip_special_tokens drops markers that are special tokens
        # (Mistral's [TOOL_CALLS], Granite's <|tool_call|>): such requests keep special tokens.
        self.tool_markers_special = tool_call_parser is not None and drops_special_markers(
            self.tokenizer, tool_call_markers(tool_call_parser))
        self.think_markers_special = self.reasoning is not None and drops_special_markers(
            self.tokenizer, (self.reasoning.start, self.reasoning.end))
        self.chat_template = chat_template
        # The roles /openapi.json lists: a request's own chat_template does not widen them (the schema cannot say so)
        self.roles = rendered_roles(lambda messages: apply_chat_template(self.tokenizer, messages, chat_template))
        self.media_options = {"allowed_local_media_path": allowed_local_media_path,
                              "allow_remote_media": allow_remote_media}

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               template_kwargs: dict[str, Any] | None = None, validate: bool = True,
               mm_processor_kwargs: dict[str, Any] | None = None, **fields: Any) -> ProcessedPrompt:
        """The conversation as a prompt, validated unless asked not to (the template carries its own BOS, so
        none is added). `template_kwargs`: the request's chat_template_kwargs; `fields`: its tools and documents;
        `mm_processor_kwargs`: the image processor's per-request options."""
        unknown = sorted({m.role for m in messages} - set(self.roles))
        if unknown and self.roles:
            raise RequestError(f"messages: role {unknown[0]!r} is not one of {', '.join(self.roles)} (the roles the "
                               "served chat template renders)", param="messages")
        add_generation_prompt, kwargs = chat_template_keywords(template_kwargs, add_generation_prompt,
                                                               continue_final_message, **fields)
        return self.engine.input.render_chat(template_messages([m.model_dump(exclude_none=True) for m in messages]),
                                             chat_template or self.chat_template, add_generation_prompt,
                                             template_kwargs=kwargs, validate=validate,
                                             mm_processor_kwargs=mm_processor_kwargs, **self.media_options)

    async def create(self, req: ChatCompletionRequest, disconnected: Disconnected | None = None
                     ) -> ChatCompletionResponse | AsyncIterator[str] | None:
        job = self._job(req)
        await self.engine.prepare_grammar(job.params)
        stream = self.open_stream(job.request_id, job.prompt, job.params, time.monotonic(), job.model)
        if req.stream:
            return sse_with_errors(self._stream(job, stream))
        finals = await final_outputs([stream], disconnected)
        return None if finals is None else self._response(job, finals[0])

    def _job(self, req: ChatCompletionRequest) -> _ChatJob:
        model = self.check_model(req.model)
        self.check_common(req)
        tools = plan_tools(req.tools, req.tool_choice, self.tool_call_parser)
        response_format = (req.response_format or {}).get("type", "text")
        if tools.constraint is not None and (req.structured_outputs or response_format != "text"):
            raise RequestError(f"tool_choice {req.tool_choice!r} constrains the output already; leave out "
                               "response_format and structured_outputs", param="tool_choice")
        if not req.messages:
            raise RequestError("messages must not be empty", param="messages")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                      prompt_logprobs=req.prompt_logprobs, structured_outputs=tools.constraint)
        if (tools.mode == "auto" and self.tool_markers_special) or self.think_markers_special:
            params = params.clone(skip_special_tokens=False)
        prompt = self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                             req.chat_template, req.chat_template_kwargs, tools=req.tools or None,
                             documents=req.documents, mm_processor_kwargs=req.mm_processor_kwargs)
        thinks_first = None if self.reasoning is None else self.reasoning.thinks_first(
            prompt.token_ids, prompt.chat_template_kwargs)
        return _ChatJob(random_id("chatcmpl"), model, prompt, params, req, tools, thinks_first)

    def _parts(self, job: _ChatJob, text: str, finished: bool) -> tuple[str | None, str | None]:
        """(thinking, answer) of an output's text; the answer is None while the output still thinks."""
        if job.thinks_first is None:
            return None, text
        return self.reasoning.split(text, job.thinks_first, finished)

    def _logprobs(self, job: _ChatJob, token_ids: list[int], seq: CompletionOutput, start: int = 0):
        if not job.req.logprobs:
            return None
        positions = (seq.logprobs or [])[start:start + len(token_ids)]
        return self.chat_logprobs(token_ids[:len(positions)], positions, job.req.top_logprobs or 0,
                                  bool(job.req.return_tokens_as_token_ids))

    def _response(self, job: _ChatJob, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for seq in out.outputs:
            reasoning, answer = self._parts(job, seq.text, True)
            content, calls = job.tools.calls(answer) if answer is not None else (None, [])
            if reasoning is not None and not content:
                content = None  # nothing after the thinking (as vLLM)
            message = ChatMessageOut(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=[
                ToolCall(id=job.tools.new_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls])
            choices.append(ChatChoice(index=seq.index, message=message,
                                      logprobs=self._logprobs(job, seq.token_ids, seq),
                                      finish_reason=_finish_reason(seq.finish_reason, calls),
                                      stop_reason=seq.stop_reason))
        completion_tokens = sum(len(seq.token_ids) for seq in out.outputs)
        return ChatCompletionResponse(
            id=job.request_id, model=job.model, choices=choices,
            usage=usage(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens),
            prompt_logprobs=self.prompt_logprobs(out, job.req.prompt_logprobs))

    async def _stream(self, job: _ChatJob, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        opts = job.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        n, num_prompt = job.params.n, len(job.prompt.token_ids)
        # Per choice: tokens, answer and thinking characters sent; whether finished.
        sent_tokens, sent_text, sent_thinking, done = [0] * n, [0] * n, [0] * n, [False] * n
        tool_ids = [job.tools.new_id() for _ in range(n)]  # of a named call, sent with its first delta

        def chunk(choice: ChatStreamChoice, tokens: int) -> str:
            return sse(_chunk(job, [choice], usage(num_prompt, tokens) if continuous else None))

        for index in range(n):
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")), 0)
        async for _, out in merge_streams([stream]):
            for seq in out.outputs:
                j, finished = seq.index, seq.finish_reason is not None
                if done[j] or (len(seq.token_ids) == sent_tokens[j] and not finished):
                    continue
                new_ids = seq.token_ids[sent_tokens[j]:]
                thinking, answer = self._parts(job, seq.text, finished)
                deltas, calls, streamed = [], [], sent_text[j]
                if answer is not None and (answer or finished):
                    deltas, calls, streamed = _deltas(job.tools, answer, sent_text[j], finished, tool_ids[j])
                deltas = _with_thinking((thinking or "")[sent_thinking[j]:], deltas)
                logprobs = self._logprobs(job, new_ids, seq, sent_tokens[j])
                sent_tokens[j], sent_text[j], done[j] = len(seq.token_ids), streamed, finished
                sent_thinking[j] = len(thinking or "")
                for k, delta in enumerate(deltas):  # the last carries the finish reason
                    last = k == len(deltas) - 1
                    yield chunk(ChatStreamChoice(
                        index=j, delta=delta, logprobs=logprobs if k == 0 else None,
                        finish_reason=_finish_reason(seq.finish_reason, calls) if last else None,
                        stop_reason=seq.stop_reason if last else None), sent_tokens[j])
        if include_usage:
            yield sse(_chunk(job, [], usage(num_prompt, sum(sent_tokens))))


def _finish_reason(reason: str | None, calls: list[ParsedCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _with_thinking(thinking: str, deltas: list[DeltaMessage]) -> list[DeltaMessage]:
    """The deltas (at least one), the first carrying the new thinking too."""
    if not deltas:
        deltas = [DeltaMessage()]
    if thinking:
        deltas[0].reasoning_content = deltas[0].reasoning = thinking
    return deltas


def _deltas(tools: ToolPlan, text: str, sent: int, finished: bool, named_id: str
            ) -> tuple[list[DeltaMessage], list[ParsedCall], int]:
    """One choice's next deltas (at least one) for its answer `text`, the calls it completes, and how much of the
    text is sent now.

    A named call streams its arguments as they come (the output is the arguments). Auto streams content up to
    where a call may begin; required and auto calls are parsed from the whole output, so they go out at the end:
    per call one delta with index, id and name, then one with its arguments."""
    if tools.mode == "none":
        return [DeltaMessage(content=text[sent:])], [], len(text)
    if tools.mode == "named":
        head = {"id": named_id, "type": "function"} if sent == 0 else {}
        name = tools.name if sent == 0 else None
        fragment = DeltaToolCall(index=0, **head, function=FunctionCall(name=name, arguments=text[sent:]))
        calls = [ParsedCall(tools.name, text)] if finished else []
        return [DeltaMessage(tool_calls=[fragment] if text[sent:] or sent == 0 else None)], calls, len(text)
    if not finished:
        safe = max(tools.streamable(text), sent) if tools.mode == "auto" else sent
        return [DeltaMessage(content=text[sent:safe] or None)], [], safe
    content, calls = tools.calls(text)
    if not calls:
        return [DeltaMessage(content=text[sent:])], [], len(text)
    # Content outside the calls that was not streamed yet (what streamed is its start, up to whitespace).
    streamed = text[:sent].strip()
    rest = content[len(streamed):] if content and content.startswith(streamed) else None
    deltas = [DeltaMessage(content=rest or None)]
    for i, call in enumerate(calls):
        deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=tools.new_id(), type="function",
                                                             function=FunctionCall(name=call.name, arguments=""))]))
        deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, function=FunctionCall(
            arguments=call.arguments))]))
    return deltas, calls, len(text)


def _chunk(job: _ChatJob, choices: list[ChatStreamChoice], chunk_usage: UsageInfo | None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=job.request_id, model=job.model, choices=choices, usage=chunk_usage)

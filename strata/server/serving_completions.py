"""POST /v1/completions: prompts (text, token ids, batches) -> engine -> a response or an SSE stream."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from strata.engine.request import ProcessedPrompt
from strata.errors import RequestError
from strata.outputs import CompletionOutput, RequestOutput
from strata.sampling_params import SamplingParams
from strata.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo, random_id
from strata.server.serving import (
    Disconnected,
    Serving,
    final_outputs,
    merge_streams,
    sse,
    sse_with_errors,
    usage,
)


@dataclass
class _Job:
    """One completions call after validation: what to run and how to present it."""

    request_id: str
    model: str
    prompts: list[ProcessedPrompt]
    params: SamplingParams
    req: CompletionRequest
    prompt_only: bool  # echo with max_tokens=0: one token is generated for the logits, then dropped


@dataclass
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    done: bool = False
    offset: int = 0  # text_offset of the next token in logprobs


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, disconnected: Disconnected | None = None
                     ) -> CompletionResponse | AsyncIterator[str] | None:
        """A response, an SSE stream (when req.stream), or None when the client left before the end."""
        job = self._job(req)
        arrival = time.monotonic()
        await self.engine.prepare_grammar(job.params)
        streams = [self.open_stream(f"{job.request_id}-{i}", p, job.params, arrival, job.model)
                   for i, p in enumerate(job.prompts)]
        if req.stream:
            return sse_with_errors(self._stream(job, streams))
        finals = await final_outputs(streams, disconnected)
        return None if finals is None else self._response(job, finals)

    def _job(self, req: CompletionRequest) -> _Job:
        model = self.check_model(req.model)
        self.check_common(req)
        if req.use_beam_search:
            raise RequestError("beam search is not supported", param="use_beam_search")
        if req.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if req.best_of is not None and (req.best_of != 1 or req.n != 1):
            raise RequestError(f"best_of={req.best_of} with n={req.n} is not supported: strata returns the samples "
                               "it draws and ranks no extra ones; leave best_of out and ask for n samples",
                               param="best_of")
        self.check_logprobs(req.logprobs, "logprobs")
        prompt_only = req.echo and req.max_tokens == 0
        max_tokens = 1 if prompt_only else req.max_tokens
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs if prompt_logprobs is not None else 0, req.logprobs)
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                      prompt_logprobs=prompt_logprobs)
        prompts = [self.engine.input.process_prompt(p, req.truncate_prompt_tokens, req.truncation_side or "left")
                   for p in _split_prompts(req.prompt)]
        return _Job(random_id("cmpl"), model, prompts, params, req, prompt_only)

    def _echo_text(self, prompt: ProcessedPrompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _choice(self, job: _Job, index: int, prompt: ProcessedPrompt, out: RequestOutput,
                seq: CompletionOutput) -> CompletionChoice:
        req = job.req
        token_ids = [] if job.prompt_only else seq.token_ids
        text = "" if job.prompt_only else seq.text
        positions = [] if job.prompt_only else (seq.logprobs or [])[:len(token_ids)]
        echo_ids: list[int] = []
        if req.echo:
            text = self._echo_text(prompt) + text
            echo_ids = list(out.prompt_token_ids)
        logprobs = None
        if req.logprobs is not None:
            prompt_positions = list(out.prompt_logprobs or [None] * len(echo_ids))[:len(echo_ids)]
            logprobs, _ = self.completion_logprobs(echo_ids + list(token_ids), prompt_positions + list(positions),
                                                   req.logprobs, as_ids=bool(req.return_tokens_as_token_ids))
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs,
            finish_reason="length" if job.prompt_only else seq.finish_reason,
            stop_reason=None if job.prompt_only else seq.stop_reason,
            prompt_logprobs=self.prompt_logprobs(out, req.prompt_logprobs),
            prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
            token_ids=list(token_ids) if req.return_token_ids else None)

    def _response(self, job: _Job, finals: list[RequestOutput]) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for i, (prompt, out) in enumerate(zip(job.prompts, finals, strict=True)):
            for seq in out.outputs:
                choices.append(self._choice(job, i * job.params.n + seq.index, prompt, out, seq))
                completion_tokens += 0 if job.prompt_only else len(seq.token_ids)
        prompt_tokens = sum(len(p.token_ids) for p in job.prompts)
        cached = sum(out.num_cached_tokens for out in finals)
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens, cached))

    async def _stream(self, job: _Job, streams: list) -> AsyncIterator[str]:
        opts = job.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        n = job.params.n
        states = [_ChoiceState() for _ in range(len(job.prompts) * n)]
        async for i, out in merge_streams(streams):
            for seq in out.outputs:
                index = i * n + seq.index
                choice = self._delta_choice(job, index, job.prompts[i], out, seq, states[index])
                if choice is None:
                    continue
                chunk_usage = None
                if continuous:
                    chunk_usage = usage(len(job.prompts[i].token_ids), states[index].num_tokens)
                yield sse(_chunk(job, [choice], chunk_usage))
        if include_usage:
            prompt_tokens = sum(len(p.token_ids) for p in job.prompts)
            completion_tokens = 0 if job.prompt_only else sum(s.num_tokens for s in states)
            yield sse(_chunk(job, [], usage(prompt_tokens, completion_tokens)))

    def _delta_choice(self, job: _Job, index: int, prompt: ProcessedPrompt, out: RequestOutput,
                      seq: CompletionOutput, state: _ChoiceState) -> CompletionChoice | None:
        """The new part of one sample since the last chunk, or None when there is nothing new."""
        finished = seq.finish_reason is not None
        if state.done or (len(seq.token_ids) == state.num_tokens and not finished):
            return None
        new_ids = [] if job.prompt_only else seq.token_ids[state.num_tokens:]
        text = "" if job.prompt_only else seq.text[state.text_len:]
        # The engine keeps appending to the logprobs list it handed out; only the first len(token_ids) count.
        positions = [] if job.prompt_only else (seq.logprobs or [])[state.num_tokens:len(seq.token_ids)]
        prefix_ids: list[int] = []
        prefix_text = ""
        if job.req.echo and not state.started:
            prefix_text, prefix_ids = self._echo_text(prompt), list(out.prompt_token_ids)
        logprobs = None
        if job.req.logprobs is not None:
            prompt_positions = list(out.prompt_logprobs or [None] * len(prefix_ids))[:len(prefix_ids)]
            logprobs, state.offset = self.completion_logprobs(
                prefix_ids + new_ids, prompt_positions + positions, job.req.logprobs, state.offset,
                bool(job.req.return_tokens_as_token_ids))
        state.started, state.done = True, finished
        state.num_tokens += len(new_ids)
        state.text_len += len(text)
        return CompletionChoice(index=index, text=prefix_text + text, logprobs=logprobs,
                                finish_reason=("length" if job.prompt_only else seq.finish_reason),
                                stop_reason=None if job.prompt_only else seq.stop_reason)


def _chunk(job: _Job, choices: list[CompletionChoice], chunk_usage: UsageInfo | None) -> CompletionResponse:
    return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=chunk_usage)


def _split_prompts(prompt: str | list) -> list[str | list[int]]:
    """One prompt per engine request: a string, a token-id list, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)

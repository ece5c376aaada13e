"""Pydantic schemas of the OpenAI-compatible HTTP API (vLLM's field names), and the error body shape."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strata.errors import RequestError, StrataError
from strata.sampling_params import MAX_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Counts beyond int64 are nonsense (and overflow tensors): 400. Large ones inside it are clamped (max_tokens) or
# checked against the engine (n) by serving.
MAX_STOP_STRINGS = 256
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI and vLLM do; serving logs their names. NaN and infinity
    # (which Python's JSON reader accepts) are refused. Strict: "5", true and 1.0 are not integers, 1 is not a
    # boolean, as /openapi.json says.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    # The ranges SamplingParams enforces, here too so that /openapi.json states them (contract.py adds the
    # served model's limits and the rules between fields).
    n: Annotated[int, Field(ge=1, le=INT64_MAX)] = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX, description="-1 or 0: no top-k")] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Count], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[Count, Field(description="capped at max_tokens")] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: LogprobCount | None = None
    return_tokens_as_token_ids: bool | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json | regex | choice | grammar | json_object
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    # list[int] first: smart-mode unions then keep token ids as ints.
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: Count | None = Field(16, description="0 only with echo: the prompt alone")
    echo: bool = False
    logprobs: LogprobCount | None = None
    best_of: int | None = None
    suffix: str | None = None
    use_beam_search: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # for RAG chat templates (`documents=` of the template)
    mm_processor_kwargs: dict[str, Any] | None = None  # the image processor's options (Qwen2.5-VL: min/max_pixels)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ----

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class LogprobEntry(BaseModel):
    """vLLM's shape of one prompt_logprobs candidate."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, LogprobEntry] | None]


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # The thinking, with --reasoning-parser: under vLLM's first name (DeepSeek's API's too) and its newer one.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # as in ChatMessageOut
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "strata"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter: a PEFT adapter folder served under a new model name."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id, which vLLM also accepts, is not needed: names are unique)."""

    lora_name: str
    lora_int_id: int | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadResponse(BaseModel):
    load: int = Field(description="requests running plus waiting")


class VersionResponse(BaseModel):
    version: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The HTTP status and OpenAI-shaped body of any exception (the one mapping of errors to HTTP)."""
    if isinstance(exc, StrataError):
        status, kind, message, param = exc.http_status, exc.error_type, exc.message, exc.param
    else:
        status, kind, param = 500, "InternalServerError", None
        message = f"Internal server error: {type(exc).__name__}: {exc}"
    return status, ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def validation_error(e: ValidationError) -> RequestError:
    """Pydantic's errors as one RequestError that names the offending field(s)."""
    parts, params = [], []
    for err in e.errors()[:4]:
        # Union members appear in `loc` as type names such as 'list[int]'; they only add noise.
        loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
        field = ".".join(loc) or "body"
        params.append(field)
        parts.append(f"{field}: {err['msg']} [type={err['type']}]")
    return RequestError("invalid request: " + "; ".join(parts), param=params[0] if params else None)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "function-after", "function-before"}

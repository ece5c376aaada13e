"""The FastAPI app: routes (documented in /openapi.json with the models they really parse and answer), the
API-key check and the one mapping of errors to HTTP. Running it (`strata serve`, drain) is in lifecycle.py."""
from __future__ import annotations

import argparse
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata import __version__
from strata.engine.async_engine import AsyncEngine
from strata.errors import AuthError, ConfigError, EngineDeadError, NotFoundError, RequestError, StrataError
from strata.server.contract import INVOCATIONS, ServedLimits, rendered_roles
from strata.server.gate import Gate, GateMiddleware, error_headers
from strata.server.lora_modules import runtime_lora_updating
from strata.server.metrics import ServerMetrics
from strata.server.openapi import install_openapi, route_doc
from strata.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    LoadResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    error_body,
    validation_error,
)
from strata.server.serving_chat import ChatServing
from strata.server.serving_completions import CompletionServing
from strata.server.serving_models import ServingModels
from strata.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

_JSON = "application/json"
_M = TypeVar("_M", bound=BaseModel)


def error_response(exc: BaseException) -> Response:
    """Every error the server answers with, in OpenAI's shape `{"error": {message, type, param, code}}`."""
    headers = error_headers(exc)
    if isinstance(exc, StarletteHTTPException):
        headers.update(exc.headers or {})  # a 405's `Allow`, which RFC 9110 requires
        exc = _http_exception_error(exc)
    elif isinstance(exc, RequestValidationError):  # only if a route ever lets FastAPI parse its body
        exc = RequestError(f"invalid request: {exc.errors()}")
    status, body = error_body(exc)
    if status >= 500 and status != 503:
        logger.error("request failed: %s", body.error.message)
    return Response(body.model_dump_json(), status_code=status, media_type=_JSON, headers=headers)


async def _handle_error(_request: Request, exc: Exception) -> Response:
    return error_response(exc)


def _http_exception_error(exc: StarletteHTTPException) -> StrataError:
    error: StrataError = NotFoundError(str(exc.detail)) if exc.status_code == 404 else RequestError(str(exc.detail))
    error.http_status = exc.status_code
    return error


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type=_JSON)


def _json_number(text: str) -> float | int:
    """JSON has one number type: 2.0 is the integer 2 (as JSON Schema counts it), so integer fields take it."""
    value = float(text)
    return int(value) if value.is_integer() else value


async def parse_body(request: Request, schema: type[_M]) -> _M:
    """Parse the body ourselves, so that bad JSON and bad fields get our 400 messages naming the field."""
    raw = await request.body()
    try:
        data = json.loads(raw, parse_float=_json_number)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}", param="body") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply", param="body") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", param="body")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _disconnect_waiter(request: Request) -> Callable[[], Any]:
    async def wait() -> None:
        # The body has been read, so the next ASGI message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def _api_key_check(api_key: str | None) -> Callable[[Request], None]:
    expected = f"Bearer {api_key}".encode() if api_key else None

    def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise AuthError("invalid or missing API key: send `Authorization: Bearer <key>`")

    return check


def _answer(result: BaseModel | AsyncIterator[str] | None) -> Response:
    if result is None:
        return Response(status_code=499)  # the client went away; nobody reads this
    if isinstance(result, BaseModel):
        return json_response(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def auto_tool_parser(args: argparse.Namespace | None) -> str | None:
    """The parser of tool_choice="auto", or None when auto is not enabled."""
    enabled = getattr(args, "enable_auto_tool_choice", False)
    parser = getattr(args, "tool_call_parser", None)
    if enabled and parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser", param="tool_call_parser")
    return parser if enabled else None


def served_limits(engine: AsyncEngine, auto_tool_choice: bool) -> ServedLimits:
    config = engine.config
    return ServedLimits(
        model_names=tuple(config.served_model_names), vocab_size=config.model.vocab_size,
        max_model_len=config.model.max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
        image_input=engine.input.accepts_images,
        empty_text_has_tokens=bool(engine.tokenizer("").input_ids), auto_tool_choice=auto_tool_choice,
        roles=rendered_roles(lambda messages: apply_chat_template(engine.tokenizer, messages, config.chat_template)))


def build_app(engine: AsyncEngine, args: argparse.Namespace | None = None, gate: Gate | None = None) -> FastAPI:
    """The HTTP app over a running engine; `args` are `strata serve`'s (api_key, disable_log_requests,
    max_waiting_requests, max_request_bytes); `gate` is shared with whoever drains the server."""
    config, names = engine.config, list(engine.config.served_model_names)
    metrics = ServerMetrics(engine, names[0])
    log_requests = not getattr(args, "disable_log_requests", False)
    models = ServingModels(engine, getattr(args, "lora_modules", None) or [])
    completions = CompletionServing(engine, metrics, log_requests, models=models)
    chat = ChatServing(engine, metrics, log_requests, models=models, chat_template=config.chat_template,
                       allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
                       allow_remote_media=getattr(args, "allow_remote_media", False),
                       tool_call_parser=auto_tool_parser(args))

    app = FastAPI(title="strata", version=__version__, description="OpenAI-compatible API (with vLLM's extra fields) "
                  "of one strata engine.")
    gate = gate or Gate(getattr(args, "max_request_bytes", None), getattr(args, "max_waiting_requests", None))
    gate.running = lambda: engine.stats()["running"]
    app.add_middleware(GateMiddleware, gate=gate)
    app.state.engine, app.state.metrics, app.state.gate = engine, metrics, gate
    for exc_type in (StrataError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(exc_type, _handle_error)
    auth = [Depends(_api_key_check(getattr(args, "api_key", None)))]
    v1 = APIRouter(prefix="/v1", dependencies=auth)

    @v1.get("/models", **route_doc(None, ModelList, auth=True))
    async def list_models() -> Response:
        return json_response(ModelList(data=models.cards(config.model.max_model_len)))

    @v1.post("/completions", **route_doc(CompletionRequest, CompletionResponse, auth=True, stream=True))
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return _answer(await completions.create(body, _disconnect_waiter(request)))

    @v1.post("/chat/completions", **route_doc(ChatCompletionRequest, ChatCompletionResponse, auth=True,
                                              stream=True))
    async def create_chat_completion(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return _answer(await chat.create(body, _disconnect_waiter(request)))

    @app.post("/invocations", dependencies=auth,
              **route_doc(INVOCATIONS, CompletionResponse | ChatCompletionResponse, auth=True, stream=True))
    async def invocations(request: Request) -> Response:
        """SageMaker's entry point: a chat body goes to chat, a completion body to completions."""
        try:
            is_chat = "messages" in json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, RecursionError):
            is_chat = False  # the completions parser reports what is wrong with the body
        return await (create_chat_completion if is_chat else create_completion)(request)

    _add_lora_routes(v1, models)
    _refuse_pooling(app, v1)
    app.include_router(v1)
    _add_plain_routes(app, engine, metrics, chat)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                          LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest],
                    [CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, ModelList, LoadResponse,
                     VersionResponse, TokenizerInfo, TokenizeResponse, DetokenizeResponse],
                    served_limits(engine, chat.tool_call_parser is not None),
                    bearer_auth=bool(getattr(args, "api_key", None)))
    return app


def _add_lora_routes(v1: APIRouter, models: ServingModels) -> None:
    """vLLM's runtime adapter routes, served only when STRATA_ / VLLM_ALLOW_RUNTIME_LORA_UPDATING is true."""
    if not runtime_lora_updating():
        return

    @v1.post("/load_lora_adapter", **route_doc(LoadLoRAAdapterRequest, "text/plain", auth=True))
    async def load_lora_adapter(request: Request) -> Response:
        """Serve a PEFT adapter folder under a new model name; a bad folder or a name in use is a 400."""
        body = await parse_body(request, LoadLoRAAdapterRequest)
        await models.load_lora(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @v1.post("/unload_lora_adapter", **route_doc(UnloadLoRAAdapterRequest, "text/plain", auth=True))
    async def unload_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        await models.unload_lora(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")


def _refuse_embeddings(v1: APIRouter) -> None:
    @v1.post("/embeddings", include_in_schema=False)
    async def embeddings() -> Response:
        raise RequestError("/v1/embeddings needs an embedding model: this server runs a generative model. Serve "
                           "an embedding checkpoint with `strata serve MODEL --runner pooling` (an encoder such as "
                           "BertModel, or a decoder such as Qwen3-Embedding; `--convert embed` turns any decoder "
                           "checkpoint into one)", param="model")


def _refuse_pooling(app: FastAPI, v1: APIRouter) -> None:
    """The pooling routes of vLLM, answered on a generative model with a 400 naming `--runner pooling`."""
    _refuse_embeddings(v1)

    async def scoring(request: Request) -> Response:
        raise RequestError(f"{request.url.path} needs a pooling model: this server runs a generative model. Serve a "
                           "cross-encoder (e.g. BertForSequenceClassification, XLMRobertaForSequenceClassification) "
                           "or an embedding model with `strata serve MODEL --runner pooling`", param="model")

    for path in ("/classify", "/score", "/rerank", "/v2/rerank"):
        app.post(path, include_in_schema=False)(scoring)
    for path in ("/score", "/rerank"):
        v1.post(path, include_in_schema=False)(scoring)


def _add_plain_routes(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, chat: ChatServing) -> None:
    """Health, load, version, metrics and tokenizer routes (outside /v1, as in vLLM: no API key)."""
    tokenizer, max_model_len = engine.tokenizer, engine.config.model.max_model_len

    @app.get("/health", **route_doc(None, None, errors=(503,)))
    async def health() -> Response:
        """200 while the server takes requests; 503 once the engine died (or while draining, from the gate)."""
        if engine.is_dead:
            raise EngineDeadError(f"the engine is dead: {engine.dead_error}")
        return Response(status_code=200)

    @app.get("/get_load", **route_doc(None, LoadResponse, errors=()))
    async def get_load() -> Response:
        """Requests running plus waiting, for routers' power-of-two choice (vllm-router, SGLang's router)."""
        stats = engine.stats()
        return json_response(LoadResponse(load=stats["running"] + stats["waiting"]))

    @app.get("/version", **route_doc(None, VersionResponse, errors=()))
    async def version() -> Response:
        return json_response(VersionResponse(version=__version__))

    @app.get("/metrics", **route_doc(None, "text/plain", errors=()))
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/tokenizer_info", **route_doc(None, TokenizerInfo, errors=()))
    async def tokenizer_info() -> Response:
        return json_response(TokenizerInfo(
            tokenizer_class=type(tokenizer).__name__, eos_token=tokenizer.eos_token,
            bos_token=tokenizer.bos_token, pad_token=tokenizer.pad_token, unk_token=tokenizer.unk_token,
            chat_template=engine.config.chat_template or getattr(tokenizer, "chat_template", None),
            model_max_length=max_model_len, vocab_size=engine.config.model.vocab_size))

    to_text = {"operationId": "detokenize", "requestBody": {"tokens": "$response.body#/tokens"},
               "description": "the tokens back to text"}
    @app.post("/tokenize", **route_doc(TokenizeRequest, TokenizeResponse, links={"Detokenize": to_text}))
    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest)
        chat.check_model(body.model)
        if body.messages is not None:
            ids = chat.render(body.messages, body.add_generation_prompt, validate=False).token_ids
        elif body.prompt is not None:
            ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        else:
            raise RequestError("give either `prompt` or `messages`", param="prompt")
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return json_response(TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                              token_strs=strs))

    @app.post("/detokenize", operation_id="detokenize", **route_doc(DetokenizeRequest, DetokenizeResponse))
    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest)
        chat.check_model(body.model)
        vocab = engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return json_response(DetokenizeResponse(prompt=tokenizer.decode(body.tokens)))

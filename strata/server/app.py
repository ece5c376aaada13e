"""The FastAPI app (routes, API-key check, the one mapping of errors to HTTP) and `run_server` for `strata serve`."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata import __version__
from strata.engine.async_engine import AsyncEngine
from strata.engine_args import EngineArgs
from strata.errors import AuthError, ConfigError, EngineDeadError, NotFoundError, RequestError, StrataError
from strata.server.metrics import ServerMetrics
from strata.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
    validation_error,
)
from strata.server.serving_chat import ChatServing
from strata.server.serving_completions import CompletionServing

logger = logging.getLogger(__name__)

_JSON = "application/json"
_M = TypeVar("_M", bound=BaseModel)


def error_response(exc: BaseException) -> Response:
    """Every error the server answers with, in OpenAI's shape `{"error": {message, type, param, code}}`."""
    if isinstance(exc, StarletteHTTPException):
        exc = _http_exception_error(exc)
    elif isinstance(exc, RequestValidationError):  # only if a route ever lets FastAPI parse its body
        exc = RequestError(f"invalid request: {exc.errors()}")
    status, body = error_body(exc)
    if status >= 500:
        logger.error("request failed: %s", body.error.message)
    return Response(body.model_dump_json(), status_code=status, media_type=_JSON)


async def _handle_error(_request: Request, exc: Exception) -> Response:
    return error_response(exc)


def _http_exception_error(exc: StarletteHTTPException) -> StrataError:
    error: StrataError = NotFoundError(str(exc.detail)) if exc.status_code == 404 else RequestError(str(exc.detail))
    error.http_status = exc.status_code
    return error


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type=_JSON)


async def parse_body(request: Request, schema: type[_M]) -> _M:
    """Parse the body ourselves, so that bad JSON and bad fields get our 400 messages naming the field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}", param="body") from None
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


def build_app(engine: AsyncEngine, args: argparse.Namespace | None = None) -> FastAPI:
    """The HTTP app over a running engine; `args` are `strata serve`'s (api_key, disable_log_requests)."""
    config = engine.config
    names = list(config.served_model_names)
    metrics = ServerMetrics(engine, names[0])
    log_requests = not getattr(args, "disable_log_requests", False)
    completions = CompletionServing(engine, metrics, log_requests)
    chat = ChatServing(engine, metrics, log_requests, chat_template=config.chat_template,
                       allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
                       allow_remote_media=getattr(args, "allow_remote_media", False),
                       tool_call_parser=auto_tool_parser(args))

    app = FastAPI(title="strata", version=__version__)
    app.state.engine, app.state.metrics = engine, metrics
    for exc_type in (StrataError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(exc_type, _handle_error)
    auth = [Depends(_api_key_check(getattr(args, "api_key", None)))]
    v1 = APIRouter(prefix="/v1", dependencies=auth)

    @v1.get("/models")
    async def models() -> Response:
        cards = [ModelCard(id=name, root=config.model.path, max_model_len=config.model.max_model_len)
                 for name in names]
        return json_response(ModelList(data=cards))

    @v1.post("/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return _answer(await completions.create(body, _disconnect_waiter(request)))

    @v1.post("/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return _answer(await chat.create(body, _disconnect_waiter(request)))

    @app.post("/invocations", dependencies=auth)
    async def invocations(request: Request) -> Response:
        """SageMaker's entry point: a chat body goes to chat, a completion body to completions."""
        try:
            is_chat = "messages" in json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
            is_chat = False  # the completions parser reports what is wrong with the body
        return await (create_chat_completion if is_chat else create_completion)(request)

    app.include_router(v1)
    _add_plain_routes(app, engine, metrics, chat)
    return app


def _add_plain_routes(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, chat: ChatServing) -> None:
    """Health, version, metrics and tokenizer routes (outside /v1, as in vLLM: no API key)."""
    tokenizer, max_model_len = engine.tokenizer, engine.config.model.max_model_len

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            raise EngineDeadError(f"the engine is dead: {engine.dead_error}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return Response(json.dumps({"version": __version__}), media_type=_JSON)

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        info = {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "unk_token": tokenizer.unk_token,
                "chat_template": engine.config.chat_template or getattr(tokenizer, "chat_template", None),
                "model_max_length": max_model_len, "vocab_size": engine.config.model.vocab_size}
        return Response(json.dumps(info), media_type=_JSON)

    @app.post("/tokenize")
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

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest)
        chat.check_model(body.model)
        vocab = engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return json_response(DetokenizeResponse(prompt=tokenizer.decode(body.tokens)))


def _resolve_model(args: argparse.Namespace) -> tuple[str, list[str] | None]:
    """The checkpoint folder and served names; no model means the built-in demo, served as `strata-demo`."""
    model = args.model or getattr(args, "model_flag", None)
    if args.model and getattr(args, "model_flag", None) and args.model != args.model_flag:
        raise RequestError(f"two different models given: {args.model!r} and --model {args.model_flag!r}",
                           param="model")
    if model is not None:
        return model, args.served_model_name
    from strata.demo import DEMO_MODEL_NAME, demo_checkpoint_path

    return str(demo_checkpoint_path()), args.served_model_name or [DEMO_MODEL_NAME]


def run_server(args: argparse.Namespace) -> int:
    """Build the engine, serve until interrupted; non-zero exit when the engine died."""
    from strata.config import EngineConfig
    from strata.tokenizer import read_chat_template

    model, names = _resolve_model(args)
    config = EngineConfig.from_args(EngineArgs.from_cli_args(args, model), served_model_name=names,
                                    chat_template=read_chat_template(args.chat_template))
    engine = AsyncEngine.from_config(config)
    # SIGTERM ends the server like Ctrl-C does, so the engine (and its workers) always shut down.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(_serve(build_app(engine, args), engine, args))
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.shutdown()
    if engine.is_dead:
        logger.error("the engine died: %s", engine.dead_error)
        return 1
    return 0


async def _serve(app: FastAPI, engine: AsyncEngine, args: argparse.Namespace) -> None:
    import uvicorn

    level = str(getattr(args, "log_level", "INFO")).lower()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=level,
                                           access_log=not args.disable_log_requests,
                                           timeout_graceful_shutdown=5))
    watchdog = asyncio.create_task(_watch(server, engine, args))
    try:
        await server.serve()
    finally:
        watchdog.cancel()


async def _watch(server: Any, engine: AsyncEngine, args: argparse.Namespace) -> None:
    """Announce the URL once listening; stop the server when the engine dies."""
    while not server.started:
        await asyncio.sleep(0.05)
    names = ", ".join(engine.config.served_model_names)
    logger.info("strata %s is serving %s at http://%s:%d/v1 (model %s)", __version__, names, args.host, args.port,
                engine.config.model.path)
    while not engine.is_dead:
        await asyncio.sleep(0.5)
    logger.error("the engine died (%s); stopping the server", engine.dead_error)
    server.should_exit = True

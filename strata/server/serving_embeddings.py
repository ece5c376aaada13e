"""The HTTP app of a pooling model (`--runner pooling`): /v1/embeddings (OpenAI's), /pooling (vLLM's), and the
refusals that name the right endpoint; plus the route a generation server answers /v1/embeddings with."""
from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata import __version__
from strata.engine.pooling_engine import EmbedResult, PoolingEngine
from strata.errors import NotFoundError, RequestError, StrataError
from strata.server.app import _api_key_check, _handle_error, json_response, parse_body
from strata.server.gate import Gate, GateMiddleware
from strata.server.protocol import INT64_MAX, ModelCard, ModelList, VersionResponse, _Request, random_id
from strata.server.serving_score import ScoreServing, add_score_routes

logger = logging.getLogger(__name__)
TokenIds = list[Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]]


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request, with vLLM's truncate_prompt_tokens."""

    # list[int] first: smart-mode unions then keep token ids as ints.
    input: TokenIds | list[TokenIds] | str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None


class EmbeddingData(BaseModel):
    object: str = "embedding"
    embedding: list[float] | str
    index: int


class PoolingData(BaseModel):
    object: str = "pooling"
    data: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData] | list[PoolingData]
    usage: EmbeddingUsage


def _encode(vector: Any, encoding_format: str) -> list[float] | str:
    """base64: the little-endian float32 bytes, as OpenAI sends them (the openai client's default)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def _inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return list(value)


class EmbeddingServing:
    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self.names = list(engine.config.served_model_names)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise NotFoundError(f"the model {model!r} does not exist; this server serves {', '.join(self.names)}",
                                param="model")

    async def create(self, body: EmbeddingRequest, pooling: bool = False) -> EmbeddingResponse:
        self.check_model(body.model)
        result: EmbedResult = await asyncio.to_thread(self.engine.embed, _inputs(body.input),
                                                      body.truncate_prompt_tokens, body.dimensions)
        fmt = body.encoding_format
        data = ([PoolingData(data=_encode(v, fmt), index=i) for i, v in enumerate(result.embeddings)] if pooling else
                [EmbeddingData(embedding=_encode(v, fmt), index=i) for i, v in enumerate(result.embeddings)])
        return EmbeddingResponse(id=random_id("embd" if not pooling else "pool"), created=int(time.time()),
                                 model=body.model or self.names[0], data=data,
                                 usage=EmbeddingUsage(prompt_tokens=result.num_tokens, total_tokens=result.num_tokens))


def build_pooling_app(engine: PoolingEngine, args: argparse.Namespace | None = None,
                      gate: Gate | None = None) -> FastAPI:
    """The app of an embedding model; `args` are `strata serve`'s (api_key, max_request_bytes)."""
    serving = EmbeddingServing(engine)
    config = engine.config
    app = FastAPI(title="strata", version=__version__, description="OpenAI-compatible embeddings API of strata.")
    gate = gate or Gate(getattr(args, "max_request_bytes", None), None)
    app.add_middleware(GateMiddleware, gate=gate)
    app.state.engine, app.state.gate = engine, gate
    for exc_type in (StrataError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(exc_type, _handle_error)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(getattr(args, "api_key", None)))])

    @v1.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        return json_response(await serving.create(await parse_body(request, EmbeddingRequest)))

    @v1.get("/models")
    async def models() -> Response:
        root = config.model.source.model if config.model.source else config.model.path
        return json_response(ModelList(data=[ModelCard(id=name, root=root, max_model_len=engine.max_model_len)
                                             for name in serving.names]))

    @v1.post("/completions")
    @v1.post("/chat/completions")
    async def generation(request: Request) -> Response:
        serves = ("/classify, /score and /rerank: it is a cross-encoder" if engine.runner.num_labels is not None
                  else "/v1/embeddings (and /pooling, /score): it is an embedding model")
        raise RequestError(f"this model serves {serves} (--runner pooling) and cannot generate text; serve a "
                           f"generative model for {request.url.path}", param="model")

    @app.post("/pooling")
    async def pooling(request: Request) -> Response:
        return json_response(await serving.create(await parse_body(request, EmbeddingRequest), pooling=True))

    @app.get("/health")
    async def health() -> Response:
        engine.check_health()  # a dead TP worker: EngineDeadError, 503
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return json_response(VersionResponse(version=__version__))

    add_score_routes(app, v1, ScoreServing(engine, serving.check_model, serving.names))
    app.include_router(v1)
    return app



def run_pooling_server(args: argparse.Namespace, config: Any) -> int:
    """`strata serve` of a pooling model: load it and serve until interrupted (uvicorn handles the signals)."""
    import uvicorn

    engine = PoolingEngine(config)
    level = getattr(args, "uvicorn_log_level", None) or str(getattr(args, "log_level", "INFO")).lower()
    access_log = not (args.disable_log_requests or getattr(args, "disable_uvicorn_access_log", False))
    routes = "/classify, /score, /rerank" if engine.runner.num_labels is not None else "/v1/embeddings"
    logger.info("strata %s is serving the pooling model %s at http://%s:%d (%s)", __version__,
                ", ".join(config.served_model_names), args.host, args.port, routes)
    try:
        uvicorn.run(build_pooling_app(engine, args), host=args.host, port=args.port, log_level=level,
                    access_log=access_log)
    finally:  # TP worker processes
        engine.shutdown()
    return 0

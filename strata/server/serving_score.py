"""/classify, /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank) of a pooling model, in vLLM's request and
response shapes (rerank also Jina's and Cohere's: query, documents, top_n, return_documents)."""
from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from strata.engine.pooling_engine import PoolingEngine
from strata.engine.scoring import ScoreResult
from strata.server.app import json_response, parse_body
from strata.server.protocol import INT64_MAX, _Request, random_id

TokenIds = list[Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]]
Truncation = Annotated[int, Field(ge=-1, le=INT64_MAX)] | None


class ClassificationRequest(_Request):
    input: TokenIds | list[TokenIds] | str | list[str]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncation = None
    use_activation: bool | None = None


class ScoreRequest(_Request):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncation = None
    use_activation: bool | None = None


class DocumentIn(_Request):
    text: str


class RerankRequest(_Request):
    query: str
    documents: list[str] | list[DocumentIn]  # Jina and Cohere's v1 take {"text": ...} objects too
    model: str | None = None
    top_n: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0  # 0: all documents
    return_documents: bool = True
    truncate_prompt_tokens: Truncation = None
    use_activation: bool | None = None


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage


class ScoreResponseData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: Usage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None  # left out with return_documents=false
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _usage(tokens: int) -> Usage:
    return Usage(prompt_tokens=tokens, total_tokens=tokens)


def _inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


class ScoreServing:
    def __init__(self, engine: PoolingEngine, check_model: Any, names: list[str]) -> None:
        self.engine, self.check_model, self.names = engine, check_model, names

    async def classify(self, body: ClassificationRequest) -> ClassificationResponse:
        self.check_model(body.model)
        result = await asyncio.to_thread(self.engine.classify, _inputs(body.input), body.truncate_prompt_tokens,
                                         body.use_activation is not False)
        data = [ClassificationData(index=i, label=label, probs=probs.tolist(), num_classes=len(probs))
                for i, (probs, label) in enumerate(zip(result.probs, result.labels, strict=True))]
        return ClassificationResponse(id=random_id("classify"), created=int(time.time()),
                                      model=body.model or self.names[0], data=data, usage=_usage(result.num_tokens))

    async def score(self, body: ScoreRequest) -> ScoreResponse:
        self.check_model(body.model)
        result: ScoreResult = await asyncio.to_thread(self.engine.score, body.text_1, body.text_2,
                                                      body.truncate_prompt_tokens, body.use_activation is not False)
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(result.scores)]
        return ScoreResponse(id=random_id("score"), created=int(time.time()), model=body.model or self.names[0],
                             data=data, usage=_usage(result.num_tokens))

    async def rerank(self, body: RerankRequest) -> RerankResponse:
        """Documents by relevance to the query, best first; `top_n` of them (all when 0)."""
        self.check_model(body.model)
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        result = await asyncio.to_thread(self.engine.score, body.query, documents, body.truncate_prompt_tokens,
                                         body.use_activation is not False, ("query", "documents"))
        order = sorted(range(len(documents)), key=lambda i: -result.scores[i])
        top = order[:body.top_n] if body.top_n else order
        results = [RerankResult(index=i, relevance_score=result.scores[i],
                                document=RerankDocument(text=documents[i]) if body.return_documents else None)
                   for i in top]
        return RerankResponse(id=random_id("rerank"), model=body.model or self.names[0], results=results,
                              usage=RerankUsage(prompt_tokens=result.num_tokens, total_tokens=result.num_tokens))


def add_score_routes(app: FastAPI, v1: APIRouter, serving: ScoreServing) -> None:
    """The routes, where vLLM has them: /classify, /score and /rerank at the root, /v1/score, /v1/rerank and
    /v2/rerank (Cohere's) beside them."""

    async def classify(request: Request) -> Response:
        return json_response(await serving.classify(await parse_body(request, ClassificationRequest)))

    async def score(request: Request) -> Response:
        return json_response(await serving.score(await parse_body(request, ScoreRequest)))

    async def rerank(request: Request) -> Response:
        return json_response(await serving.rerank(await parse_body(request, RerankRequest)))

    app.post("/classify")(classify)
    app.post("/score")(score)
    app.post("/rerank")(rerank)
    v1.post("/score")(score)
    v1.post("/rerank")(rerank)
    app.post("/v2/rerank", dependencies=v1.dependencies)(rerank)

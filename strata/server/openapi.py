"""/openapi.json from the pydantic models the routes really parse and answer with. The routes read their bodies
themselves (for our own 400 messages), so each declares its documentation here, and the models are added to
the components when the document is first built."""
from __future__ import annotations

import types
from typing import Any, Union, get_args

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel

from strata.server.contract import ServedLimits, add_request_contract
from strata.server.protocol import ChatCompletionChunk, ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Invalid request (a field, the JSON or the prompt)",
    401: "Missing or wrong API key",
    404: "Unknown model or route",
    413: "Request body larger than --max-request-bytes",
    503: "Overloaded (--max-waiting-requests), draining or engine dead; see Retry-After",
}
_STREAM_DOC = ("With `stream: true`: server-sent events, each `data: <JSON chunk>` (the response model, or "
               f"{ChatCompletionChunk.__name__} for chat), an error chunk if the request fails midway, and "
               "always `data: [DONE]` last.")


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, types.UnionType) or getattr(annotation, "__origin__", None) is Union:
        return [m for a in get_args(annotation) for m in _models(a)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _schema_of(annotation: Any) -> dict[str, Any]:
    names = [annotation] if isinstance(annotation, str) else [m.__name__ for m in _models(annotation)]
    refs = [{"$ref": _REF.format(model=name)} for name in names]
    return refs[0] if len(refs) == 1 else {"anyOf": refs}


def route_doc(request: Any, response: Any, *, auth: bool = False, stream: bool = False,
              errors: tuple[int, ...] = (400, 404, 413, 503), links: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keywords for a route decorator: its JSON body (`request`, a model, a union or a component's name), its
    200 answer (a model, a union, a media type string, or None for an empty body), its error answers (all in
    ErrorResponse) and the OpenAPI links from its answer to other routes."""
    if isinstance(response, str):
        ok: dict[str, Any] = {"description": "OK", "content": {response: {"schema": {"type": "string"}}}}
    elif response is None:
        ok = {"description": "OK (empty body)"}
    else:
        ok = {"description": "OK", "content": {"application/json": {"schema": _schema_of(response)}}}
        if stream:
            # Before OpenAPI 3.2, an event stream's `schema` describes one event.
            event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
                     "description": _STREAM_DOC}
            ok["content"]["text/event-stream"] = {"schema": event}
    if links:
        ok["links"] = links
    codes = sorted({*errors, *((401,) if auth else ())})
    responses: dict[int | str, Any] = {200: ok}
    responses.update({code: {"description": _ERRORS[code], "model": ErrorResponse} for code in codes})
    extra: dict[str, Any] = {}
    if request is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": _schema_of(request)}}}
    # A plain Response class: FastAPI then adds no JSON body of its own to what is documented here.
    return {"responses": responses, "openapi_extra": extra, "response_class": Response}


def install_openapi(app: FastAPI, requests: list[type[BaseModel]], answers: list[type[BaseModel]],
                    limits: ServedLimits, bearer_auth: bool = False) -> None:
    """Make app.openapi() add the models the routes' docs refer to: `requests` as they validate (and as the
    served model's limits and the server's rules between fields tighten them), `answers` as they serialize;
    with `bearer_auth` (--api-key), the routes that answer 401 ask for `Authorization: Bearer <key>`."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for mode, models in (("validation", requests), ("serialization", answers)):
                for model in models:
                    _add_model(components, model, mode)
            add_request_contract(components, limits)
            if bearer_auth:
                schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
                for operation in (op for ops in schema["paths"].values() for op in ops.values()):
                    if "401" in operation["responses"]:
                        operation["security"] = [{"apiKey": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


def _add_model(components: dict[str, Any], model: type[BaseModel], mode: str) -> None:
    schema = model.model_json_schema(ref_template=_REF, mode=mode)  # type: ignore[arg-type]
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components[model.__name__] = schema

"""Requests' constraints: OpenAI's `response_format` and vLLM's `structured_outputs` -> StructuredOutputsParams,
each error a 400 naming the parameter."""
from __future__ import annotations

from typing import Any

from strata.errors import RequestError
from strata.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams
from strata.structured.grammar import validate

_FIELDS = (*STRUCTURED_KINDS, "disable_any_whitespace")


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise RequestError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise RequestError("response_format of type json_schema: json_schema (with its schema) must be provided",
                           param="response_format")
    return StructuredOutputsParams(json=spec["schema"])


def from_structured_outputs(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise RequestError(f"structured_outputs has unknown fields {unknown}; the fields are {list(_FIELDS)}",
                           param="structured_outputs")
    if not isinstance(value.get("disable_any_whitespace", False), bool | None):
        raise RequestError("structured_outputs.disable_any_whitespace must be a boolean",
                           param="structured_outputs.disable_any_whitespace")
    return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})


def request_constraint(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
                       ) -> StructuredOutputsParams | None:
    """The request's one constraint, its schema checked (keywords the backend cannot enforce are named)."""
    try:
        by_format = from_response_format(response_format)
    except RequestError as e:
        raise RequestError(e.message, param="response_format") from None
    by_field = from_structured_outputs(structured_outputs)
    if by_format is not None and by_field is not None:
        raise RequestError("give either response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if by_format is not None:
            validate(by_format)
        elif by_field is not None:
            validate(by_field)
    except RequestError as e:
        raise RequestError(e.message, param="response_format" if by_format is not None else e.param) from None
    return by_format or by_field

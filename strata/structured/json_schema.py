"""Which JSON-schema keywords the grammar backend enforces; a schema using any other is refused by name, never
silently loosened (xgrammar ignores, for example, `allOf`, `uniqueItems`, `contains`, unknown formats and most
`multipleOf`s)."""
from __future__ import annotations

import json
from typing import Any

from strata.errors import RequestError

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions"}
ENFORCED = {
    "type", "enum", "const", "anyOf", "$ref",
    "properties", "required", "additionalProperties", "minProperties", "maxProperties", "patternProperties",
    "propertyNames",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
}
FORMATS = {"email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
           "uri-reference"}
TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# Why a keyword is refused, where a user may wonder: xgrammar (0.2.9) drops `multipleOf` on numbers, on one-sided
# or wide ranges and past 1024, and without a range writes an unbounded run of digits.
_HINTS = {"oneOf": " (use anyOf)", "multipleOf": " (list the allowed values in an enum)"}


def load_schema(schema: str | dict[str, Any], param: str) -> dict[str, Any] | bool:
    """The schema as an object, its JSON checked; every keyword it uses must be one the backend enforces."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON object, got {type(schema).__name__}", param=param)
    check_schema(schema, param, "#")
    return schema


def check_schema(schema: Any, param: str, path: str) -> None:
    """Refuse what cannot be enforced (naming the keyword and where it is) and what is not a schema at all."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: the schema at {path} must be an object or a boolean", param=param)
    for keyword, value in schema.items():
        if keyword in ANNOTATIONS - {"$defs", "definitions"}:
            continue
        if keyword not in ENFORCED and keyword not in SUBSCHEMA_MAPS:
            hint = _HINTS.get(keyword, "")
            raise RequestError(f"{param}: the JSON-schema keyword {keyword!r} at {path} cannot be enforced by the "
                               f"structured-outputs backend{hint}", param=param)
        _check_keyword(keyword, value, param, f"{path}/{keyword}")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise RequestError(f"{param}: 'pattern' together with 'minLength'/'maxLength' at {path} cannot be enforced; "
                           "put the length into the pattern", param=param)


def _check_keyword(keyword: str, value: Any, param: str, path: str) -> None:
    def bad(why: str) -> RequestError:
        return RequestError(f"{param}: {path} {why}", param=param)

    if keyword == "type":
        types = value if isinstance(value, list) else [value]
        if not types or any(not isinstance(t, str) or t not in TYPES for t in types):
            raise bad(f"must be one of {sorted(TYPES)} (or a list of them), got {value!r}")
    elif keyword in SUBSCHEMA_MAPS:
        if not isinstance(value, dict):
            raise bad("must be an object of schemas")
        for name, sub in value.items():
            check_schema(sub, param, f"{path}/{name}")
    elif keyword in ("additionalProperties", "items", "propertyNames"):
        check_schema(value, param, path)
    elif keyword in ("anyOf", "prefixItems"):
        if not isinstance(value, list) or not value:
            raise bad("must be a non-empty array of schemas")
        for i, sub in enumerate(value):
            check_schema(sub, param, f"{path}/{i}")
    elif keyword == "enum" and (not isinstance(value, list) or not value):
        raise bad("must be a non-empty array")
    elif keyword == "required" and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
        raise bad("must be an array of property names")
    elif keyword in ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(f"must be a non-negative integer, got {value!r}")
    elif keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad(f"must be a number, got {value!r}")
    elif keyword == "format" and (not isinstance(value, str) or value not in FORMATS):
        raise bad(f"{value!r} cannot be enforced; the supported formats are {', '.join(sorted(FORMATS))}")
    elif keyword in ("pattern", "$ref") and not isinstance(value, str):
        raise bad("must be a string")

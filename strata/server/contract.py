"""What /openapi.json promises about requests beyond their pydantic field types: the served model's limits
(names, vocabulary, context, --max-num-seqs, content kinds), the shapes of the object-valued fields and the rules
between fields. Each is a check the server makes (serving*.py, tools.py, structured/), written here as JSON Schema
so that clients and fuzzers stop where the server stops; tests/server/test_fuzz.py holds the two together."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata.multimodal.chat import IMAGE_PARTS, TEXT_PARTS
from strata.sampling_params import STRUCTURED_KINDS
from strata.server.protocol import INT64_MAX
from strata.structured.json_schema import ANNOTATIONS, ENFORCED, FORMATS, SUBSCHEMA_MAPS, TYPES

JsonSchema = dict[str, Any]
INVOCATIONS = "InvocationsRequest"  # the component of /invocations' body
_REF = "#/components/schemas/{name}"
_NULL: JsonSchema = {"type": "null"}
_TEXT_FORMAT: JsonSchema = {
    "properties": {"response_format": {"anyOf": [_NULL, {"properties": {"type": {"const": "text"}}}]}},
    "description": "response_format absent, null or text"}


@dataclass(frozen=True)
class ServedLimits:
    """What the served engine decides about requests."""

    model_names: tuple[str, ...]
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    image_input: bool
    empty_text_has_tokens: bool  # the tokenizer turns "" into tokens of its own (a BOS), so "" is a prompt
    auto_tool_choice: bool  # --enable-auto-tool-choice
    roles: tuple[str, ...] = ()  # the message roles the chat template renders (rendered_roles)


ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's message roles


def rendered_roles(render: Callable[[list[dict[str, Any]]], object]) -> tuple[str, ...]:
    """The roles of ROLES a chat template renders (`render` raises on the others, as the demo model's template does
    for all but system, user and assistant): in a message alone, after a user message or before one. Empty where
    it renders a made-up role too: any role goes, custom ones (vLLM's "narrator") included."""
    def renders(role: str) -> bool:
        message, user = {"role": role, "content": "x"}, {"role": "user", "content": "x"}
        for messages in ([message], [user, message], [message, user]):
            try:
                render(messages)
                return True
            except Exception:  # noqa: BLE001, S112 - a template refuses in whatever way its author chose
                continue
        return False

    if renders("strata-made-up-role"):
        return ()
    return tuple(role for role in ROLES if renders(role))


def add_request_contract(components: dict[str, JsonSchema], limits: ServedLimits) -> None:
    """Tighten the request models' component schemas (as pydantic wrote them) to what the server accepts."""
    components["JsonSchema"] = json_schema_schema()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _sampling_fields(components[name], limits)
    _completion_fields(components["CompletionRequest"], limits)
    _chat_fields(components["ChatCompletionRequest"], limits)
    _content_part(components["ContentPart"], limits)
    if limits.roles:
        components["ChatMessage"]["properties"]["role"] = {
            "type": "string", "enum": list(limits.roles),
            "description": "the roles the served chat template renders (also with a request's own chat_template)"}
    tokenize = components["TokenizeRequest"]
    tokenize["properties"]["model"] = _model_name(limits)
    tokenize.setdefault("allOf", []).append({
        "description": "`prompt` or `messages` (messages win when both are given)",
        "anyOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    detokenize = components["DetokenizeRequest"]
    detokenize["properties"]["model"] = _model_name(limits)
    detokenize["properties"]["tokens"] = _token_ids(limits, min_items=0)
    components[INVOCATIONS] = {
        "description": "SageMaker's entry point: a body with `messages` is a chat request, any other a completion",
        "anyOf": [{"allOf": [{"$ref": _REF.format(name="CompletionRequest")}], "not": {"required": ["messages"]}},
                  {"$ref": _REF.format(name="ChatCompletionRequest")}]}


def json_schema_schema() -> JsonSchema:
    """A JSON Schema of the kind the structured-outputs backend enforces: strata.structured.json_schema refuses
    every other keyword by name, and values of the wrong kind. What only words can say: `$ref`s must resolve and
    `pattern`s must compile."""
    keywords = sorted(ENFORCED | ANNOTATIONS | set(SUBSCHEMA_MAPS))
    sub = {"anyOf": [{"$ref": _REF.format(name="JsonSchema")}, {"type": "boolean"}]}
    subs, by_name = {"type": "array", "minItems": 1, "items": sub}, {"type": "object", "additionalProperties": sub}
    count, number, type_name = {"type": "integer", "minimum": 0}, {"type": "number"}, {"enum": sorted(TYPES)}
    values: dict[str, JsonSchema] = {
        "type": {"anyOf": [type_name, {"type": "array", "minItems": 1, "items": type_name}]},
        "enum": {"type": "array", "minItems": 1}, "required": {"type": "array", "items": {"type": "string"}},
        "anyOf": subs, "prefixItems": subs, **dict.fromkeys(SUBSCHEMA_MAPS, by_name),
        **dict.fromkeys(("additionalProperties", "items", "propertyNames"), sub),
        **dict.fromkeys(("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"), count),
        **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), number),
        "format": {"enum": sorted(FORMATS)}, "pattern": {"type": "string"},  # must compile: said in words
        "$ref": {"type": "string"}}
    assert set(values) <= set(keywords)
    return {"type": "object", "propertyNames": {"enum": keywords}, "properties": values,
            "not": {"required": ["pattern"], "anyOf": [{"required": ["minLength"]}, {"required": ["maxLength"]}]},
            "description": "A JSON Schema (an object) using only these keywords (anyOf, not oneOf), at every level; "
                           "`$ref`s must resolve, `pattern`s must compile, and a `pattern` cannot be combined "
                           f"with minLength/maxLength. Formats: {', '.join(sorted(FORMATS))}."}


def _model_name(limits: ServedLimits) -> JsonSchema:
    return {"anyOf": [{"type": "string", "enum": [*limits.model_names, ""]}, _NULL],
            "description": "A served model name (GET /v1/models); empty or absent: the first. Others get 404."}


def _token_ids(limits: ServedLimits, *, min_items: int) -> JsonSchema:
    return {"type": "array", "minItems": min_items,
            "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}


def _either(*alternatives: JsonSchema, description: str) -> JsonSchema:
    return {"description": description, "anyOf": list(alternatives)}


def _is(field: str, value: Any) -> JsonSchema:
    return {"required": [field], "properties": {field: {"const": value}}}


def _null_or(field: str, schema: JsonSchema) -> JsonSchema:
    """`field` absent, null, or as `schema` says."""
    return {"properties": {field: {"anyOf": [_NULL, schema]}}}


def _absent(field: str) -> JsonSchema:
    """`field` absent or null."""
    return {"properties": {field: _NULL}}


def _all(*schemas: JsonSchema) -> JsonSchema:
    return {"allOf": list(schemas)}


def _sampling_fields(schema: JsonSchema, limits: ServedLimits) -> None:
    props = schema["properties"]
    props["model"] = _model_name(limits)
    props["n"] = {"type": "integer", "minimum": 1, "maximum": limits.max_num_seqs, "default": 1,
                  "description": "samples per prompt, at most --max-num-seqs"}
    props["logit_bias"] = {"anyOf": [{"type": "object", "maxProperties": 0}, _NULL],
                           "description": "not supported: only null or {}"}
    props["response_format"] = {"anyOf": [_response_format(), _NULL]}
    props["structured_outputs"] = {"anyOf": [_structured_outputs(), _NULL]}
    # Rules on the same fields go into one anyOf: generators expand each anyOf against the others.
    schema.setdefault("allOf", []).append(
        _either(_all(_is("stream", True), _absent("prompt_logprobs")),
                _all(_null_or("stream", {"const": False}), _absent("stream_options")),
                description="stream_options only with stream: true; prompt_logprobs cannot be streamed"))
    if "messages" not in props:  # chat's constraints include the tool choice's
        schema["allOf"].append(_either(_absent("structured_outputs"), _TEXT_FORMAT,
                                       description="one constraint: response_format (json_object, json_schema) "
                                                   "or structured_outputs"))


def _completion_fields(schema: JsonSchema, limits: ServedLimits) -> None:
    props = schema["properties"]
    text = {"type": "string", "minLength": 0 if limits.empty_text_has_tokens else 1}
    ids = _token_ids(limits, min_items=1)
    props["prompt"] = {"anyOf": [ids, {"type": "array", "minItems": 1, "items": ids}, text,
                                 {"type": "array", "minItems": 1, "items": text}],
                       "description": "text, token ids, or a batch of either; after truncate_prompt_tokens, it "
                                      f"must leave the context ({limits.max_model_len} tokens) a token to generate"}
    props["best_of"] = {"anyOf": [{"type": "integer", "const": 1}, _NULL],
                        "description": "1 or null: strata ranks no extra samples (use n for several)"}
    props["suffix"] = {"anyOf": [{"type": "string", "maxLength": 0}, _NULL], "description": "not supported"}
    props["use_beam_search"] = {"type": "boolean", "const": False, "default": False,
                                "description": "not supported"}
    props["truncate_prompt_tokens"] = {
        "anyOf": [{"type": "integer", "const": -1}, {"type": "integer", "minimum": 1, "maximum": INT64_MAX}, _NULL],
        "description": "keep this many prompt tokens (-1: the context length)"}
    schema["allOf"].extend([
        _either(_is("echo", True), _null_or("max_tokens", {"minimum": 1}),
                description="max_tokens 0 (the prompt alone) needs echo"),
        _either(_absent("best_of"), _null_or("n", {"const": 1}), description="best_of 1 only with n 1"),
    ])


def _chat_fields(schema: JsonSchema, limits: ServedLimits) -> None:
    props = schema["properties"]
    props["tools"] = {"anyOf": [{"type": "array", "items": _tool()}, _NULL],
                      "description": "functions the model may call; each name once"}
    choices = ["none", "required", *(["auto"] if limits.auto_tool_choice else [])]
    named = {"type": "object", "required": ["function"],
             "properties": {"type": {"const": "function"},
                            "function": {"type": "object", "required": ["name"],
                                         "properties": {"name": {"type": "string"}}}},
             "description": "call this function, which must be one of `tools`"}
    props["tool_choice"] = {"anyOf": [{"type": "string", "enum": choices}, named, _NULL],
                            "description": '"auto" needs --enable-auto-tool-choice'}
    tools_given = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    no_tool_choice = _null_or("tool_choice", {"const": "none"})
    auto = [_all(_is("tool_choice", "auto"), tools_given, no_constraint)
            for no_constraint in (_absent("structured_outputs"), _TEXT_FORMAT)] if limits.auto_tool_choice else []
    schema["allOf"].extend([
        _either(_all(no_tool_choice, _absent("structured_outputs")), _all(no_tool_choice, _TEXT_FORMAT), *auto,
                _all({"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["none", "auto"]}}}},
                     tools_given, _absent("structured_outputs"), _TEXT_FORMAT),
                description="a tool_choice other than none needs tools; one constraint at most: a required or "
                            "named tool_choice, response_format (json_object, json_schema) or structured_outputs"),
        _either(_null_or("top_logprobs", {"const": 0}), _is("logprobs", True),
                description="top_logprobs needs logprobs: true"),
        _either(_null_or("continue_final_message", {"const": False}), _is("add_generation_prompt", False),
                description="continue_final_message needs add_generation_prompt: false"),
    ])


def _content_part(schema: JsonSchema, limits: ServedLimits) -> None:
    kinds = sorted(TEXT_PARTS) + (sorted(IMAGE_PARTS) if limits.image_input else [])
    schema["properties"]["type"] = {"type": "string", "enum": kinds,
                                    "description": "text parts" + (", image parts (image_url: a URL or "
                                                                    "{url})" if limits.image_input else
                                                                    " only: this model is text-only")}


def _response_format() -> JsonSchema:
    json_schema = {"type": "object", "required": ["schema"],
                   "properties": {"name": {"description": "not checked"}, "schema": _constraint_schema(),
                                  "strict": {"description": "not checked: the schema is always enforced"}}}
    return {"type": "object", "description": "OpenAI's: absent type means text",
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": {}},
            "anyOf": [{"not": {"required": ["type"]}}, {"properties": {"type": {"enum": ["text", "json_object"]}}},
                      {"required": ["json_schema"], "properties": {"json_schema": json_schema}}]}


def _constraint_schema() -> JsonSchema:
    # The server also takes the schema as JSON text (as vLLM does), which JSON Schema cannot tell from any other
    # string: documented in words, or generators would send strings that are not JSON and expect them accepted.
    return {"allOf": [{"$ref": _REF.format(name="JsonSchema")}],
            "description": "a JsonSchema object (its JSON text in a string is accepted too)"}


def _structured_outputs() -> JsonSchema:
    kinds: dict[str, JsonSchema] = {
        "json": _constraint_schema(),
        "regex": {"type": "string", "format": "regex"},
        "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "grammar": {"type": "string", "description": "an EBNF grammar (xgrammar's dialect), rule `root` first"},
        "json_object": {"const": True},
    }
    assert tuple(kinds) == STRUCTURED_KINDS
    properties = {kind: {"anyOf": [schema, _NULL]} for kind, schema in kinds.items()}
    properties["disable_any_whitespace"] = {"type": ["boolean", "null"]}
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "description": "vLLM's: exactly one of " + ", ".join(kinds),
            "oneOf": [{"required": [kind], "properties": {kind: {"not": _NULL}}} for kind in kinds]}


def _tool() -> JsonSchema:
    parameters = {"anyOf": [_constraint_schema(), _NULL]}
    function = {"type": "object", "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}, "description": {},
                               "parameters": parameters}}
    return {"type": "object", "required": ["function"],
            "properties": {"type": {"const": "function"}, "function": function}}

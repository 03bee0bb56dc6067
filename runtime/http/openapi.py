"""The server's /openapi.json: what it accepts and answers, as exactly as JSON Schema says it.

FastAPI's document is built from the routes; the request bodies (parsed by the server itself, `protocol.py`) are
added from their pydantic models, then tightened where a model's validator refuses more than its type says:
fields accepted only at a neutral value (`protocol.NEUTRAL_*`) list those values; `max_tokens` >= 1; stop strings
non-empty, at most 16; prompts and token ids non-empty and inside the vocabulary; `/tokenize` takes exactly one of
`prompt` and `messages`; the structured-output fields have `structured.py`'s shapes. Refusals the schema cannot state (a prompt beyond the context, text the tokenizer cannot
encode, a constraint the grammar library refuses) stay 400s with their reason. `/metrics` is Prometheus text,
streamed answers `text/event-stream`, and every error `ErrorResponse` (FastAPI's 422 is never answered: this server
refuses with 400). With an API key the protected routes (`auth.protected`) declare bearer auth and their 401.
"""

from __future__ import annotations

from typing import Any

from fastapi.openapi.utils import get_openapi

from . import protocol as P
from .auth import protected

NEUTRAL = {"CompletionRequest": P.NEUTRAL_COMPLETION, "ChatCompletionRequest": P.NEUTRAL_CHAT}
ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
STREAMED = ("/v1/completions", "/v1/chat/completions")


def _branch(prop: dict, kind: str) -> dict:
    """The `kind` ("string", "integer", "array") schema of a property, itself or its anyOf branch."""
    if prop.get("type") == kind:
        return prop
    return next(b for b in prop.get("anyOf", ()) if b.get("type") == kind)


UNSET = {"enum": [None, False]}  # a structured_outputs key that is absent, null or false is not set
STRUCTURED = {  # runtime/http/structured.py's shapes
    "response_format": {
        "anyOf": [{"type": "null"}, {
            "type": "object", "required": ["type"], "additionalProperties": False,
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": {}},
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": {
                "type": "object", "required": ["schema"], "properties": {"schema": {"type": ["object", "boolean"]}}}}},
        }]},
    "guided_regex": {"type": ["string", "null"]},
    "guided_choice": {"type": ["array", "null"]},
    "guided_json": {"type": ["string", "object", "boolean", "null"]},
    "structured_outputs": {"anyOf": [{"type": "null"}, {
        "type": "object", "additionalProperties": UNSET,
        "properties": {"regex": {"anyOf": [{"type": "string"}, UNSET]}, "choice": {"anyOf": [{"type": "array"}, UNSET]},
                       "json": {"type": ["string", "object", "boolean", "null"]},
                       "json_object": {"enum": [True, False, None]}}}]},
}


TOOLS = {  # runtime/http/tool_calls.py's shapes (each tool's own checks are 400s naming tools[i])
    "tools": {"type": ["array", "null"]},
    "parallel_tool_calls": {"type": ["boolean", "null"]},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"const": "function"},
                       "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
}


def _tighten(components: dict, vocab: int) -> None:
    ids = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _branch(props[field], "integer")["minimum"] = 1
        _branch(props["stop"], "string")["minLength"] = 1
        stops = _branch(props["stop"], "array")
        stops.update(maxItems=16)
        stops["items"]["minLength"] = 1
        for field, shape in (TOOLS if name == "ChatCompletionRequest" else {}).items():
            props[field] = {**shape, "description": "tool calls (docs/constrained.md#tool-calls)"}
        for field, shape in STRUCTURED.items():
            props[field] = {**shape, "description": "structured outputs (docs/constrained.md); at most one field "
                                                    "per request"}
        for field, (ok, why) in NEUTRAL[name].items():  # accepted absent, null, or at a neutral value
            props[field] = {"enum": [*ok, None], "description": f"accepted only as {list(ok)} or null: {why}"}
    prompt = components["CompletionRequest"]["properties"]["prompt"]
    text, texts, tokens, lists = prompt["anyOf"]
    text["minLength"] = 1
    texts.update(minItems=1, items={"type": "string", "minLength": 1})
    tokens.update(minItems=1, items=ids)
    lists.update(minItems=1, items={"type": "array", "minItems": 1, "items": ids})
    tok = components["TokenizeRequest"]
    tok["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
    tok["properties"]["prompt"] = {"type": "string"}  # "" is 0 tokens without special tokens, a 400 with them
    tok["properties"]["messages"] = {"type": "array", "minItems": 1,
                                     "items": {"$ref": "#/components/schemas/ChatMessage"}}
    components["DetokenizeRequest"]["properties"]["tokens"]["items"] = ids


def _media(paths: dict, metrics: bool) -> None:
    for ops in paths.values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code, r in responses.items():
                if code != "200":
                    r["content"] = {"application/json": {"schema": ERROR}}
    get = paths["/metrics"]["get"]
    get["responses"] = {"200": {"description": "Prometheus text", "content": {"text/plain": {"schema":
                                                                                              {"type": "string"}}}}}
    if not metrics:
        get["responses"]["404"] = {"description": "metrics are off", "content": {"application/json": {"schema": ERROR}}}
    for path in STREAMED:
        paths[path]["post"]["responses"]["200"]["content"]["text/event-stream"] = {  # each event
            "schema": {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                       "description": "stream: true: SSE events `data: <chunk JSON>`, then `data: [DONE]`; with "
                                      "stream_options.include_canvas_frames, chunks whose choice carries "
                                      "`canvas_frame` {block, step, text, tokens, accepted, mean_entropy} (empty "
                                      "regular text) before each block's own"}}


def _auth(schema: dict) -> None:
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in schema["paths"].items():
        if protected(path):
            for op in ops.values():
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = {"description": "no or a wrong API key (dgemma serve --api-key)",
                                          "content": {"application/json": {"schema": ERROR}}}


def document(app, bodies: dict[str, type], *, vocab: int, metrics: bool, api_key: bool,
             model_name: str | None = None) -> dict[str, Any]:
    """The OpenAPI document of `app` (see the module docstring); `bodies`: path -> its request model; `vocab` the
    tokenizer's size (token ids are < it); `metrics`: /metrics is served; `api_key`: the protected routes need one;
    `model_name`: the served model's id, given as the example of `/v1/models/{model_id}`."""
    schema = get_openapi(title=app.title, version="1", routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, never answered here
        components.pop(name, None)
    for model in (*bodies.values(), P.ErrorResponse):
        s = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(s.pop("$defs", {}))
        components[model.__name__] = s
    _tighten(components, vocab)
    _media(schema["paths"], metrics)
    for param in schema["paths"].get("/v1/models/{model_id}", {}).get("get", {}).get("parameters", []):
        if model_name is not None and param.get("name") == "model_id":
            param["schema"]["examples"] = [model_name]
    if api_key:
        _auth(schema)
    return schema

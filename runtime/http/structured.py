"""Structured-output fields of a request -> one `dgemma_compile.inputs.constraint.Constraint` (docs/constrained.md).

Accepted on both routes (`/v1/completions` and `/v1/chat/completions`):
- OpenAI's `response_format`: {"type": "text"} (none), {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- vLLM's extensions: the `guided_regex` (string), `guided_choice` (list of strings) and `guided_json` (a schema
  object or its JSON text) fields, and their successor `structured_outputs` ({"regex": ...} | {"choice": [...]} |
  {"json": schema} | {"json_object": true}; other keys, e.g. "grammar" or "structural_tag", are refused).
At most one of them may constrain a request. Every refusal is a 400 naming the field (`APIError`); a schema or regex
the grammar library cannot compile is refused by the engine (`Engine.submit`), named as the field it came from.
"""

from __future__ import annotations

import json
from typing import Any

from dgemma_compile.model.config import ConfigError
from dgemma_compile.inputs.constraint import Constraint

from .protocol import APIError

FIELDS = ("response_format", "guided_regex", "guided_choice", "guided_json", "structured_outputs")
"""The request fields that can carry a constraint, in the order they are read."""


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _response_format(v: Any) -> Constraint | None:
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise _bad("response_format", 'must be an object with a "type": "text", "json_object" or "json_schema"')
    kind = v["type"]
    extra = set(v) - {"type", "json_schema"}
    if extra:
        raise _bad("response_format", f"unknown field(s) {sorted(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise _bad("response_format", f'type {kind!r} is not supported (accepted: "text", "json_object", '
                                      f'"json_schema")')
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise _bad("response_format", 'a "json_schema" response format needs "json_schema": {"name": ..., '
                                      '"schema": {...}}')
    if not isinstance(spec["schema"], (dict, bool)):
        raise _bad("response_format", "json_schema.schema must be a JSON schema object")
    return Constraint.json_schema(spec["schema"])


def _schema(param: str, v: Any) -> Constraint:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise _bad(param, f"not valid JSON ({e})") from None
    if not isinstance(v, (dict, bool)):
        raise _bad(param, "must be a JSON schema object")
    return Constraint.json_schema(v)


def _structured_outputs(v: Any) -> Constraint | None:
    param = "structured_outputs"
    if not isinstance(v, dict):
        raise _bad(param, "must be an object")
    set_ = {k: x for k, x in v.items() if x is not None and x is not False}
    known = {"regex", "choice", "json", "json_object"}
    unknown = set(set_) - known
    if unknown:
        raise _bad(param, f"{sorted(unknown)} not supported by this server (accepted: {sorted(known)})")
    if len(set_) > 1:
        raise _bad(param, f"give one of {sorted(known)}, got {sorted(set_)}")
    if not set_:
        return None
    (key, x), = set_.items()
    if key == "regex":
        return Constraint.regex(x) if isinstance(x, str) else _raise(_bad(param, "regex must be a string"))
    if key == "choice":
        return _choice(param, x)
    if key == "json":
        return _schema(param, x)
    if x is not True:
        raise _bad(param, "json_object must be true")
    return Constraint.json_object()


def _raise(e: Exception):
    raise e


def _choice(param: str, x: Any) -> Constraint:
    if not isinstance(x, list):
        raise _bad(param, "must be a list of strings")
    return Constraint.choice(x)


def request_constraint(values: dict[str, Any]) -> tuple[Constraint | None, str | None]:
    """(the constraint, the field it came from) of a request's structured-output fields (`FIELDS`: name -> value,
    None when absent), or (None, None). Raises APIError (400 naming the field) for a malformed value or more than one
    constraining field."""
    found: list[tuple[Constraint, str]] = []
    for name in FIELDS:
        v = values.get(name)
        if v is None:
            continue
        try:
            if name == "response_format":
                c = _response_format(v)
            elif name == "guided_regex":
                c = Constraint.regex(v) if isinstance(v, str) else _raise(_bad(name, "must be a string"))
            elif name == "guided_choice":
                c = _choice(name, v)
            elif name == "guided_json":
                c = _schema(name, v)
            else:
                c = _structured_outputs(v)
        except ConfigError as e:  # Constraint's own checks (param "constraint": the request's field here)
            raise _bad(name, e.problem if e.param == "constraint" else str(e)) from None
        if c is not None:
            found.append((c, name))
    if len(found) > 1:
        raise APIError(400, f"{found[1][1]}: only one structured-output field may constrain a request, got "
                            f"{', '.join(n for _, n in found)}", param=found[1][1])
    return found[0] if found else (None, None)

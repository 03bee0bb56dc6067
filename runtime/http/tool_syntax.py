"""Gemma4's tool-call syntax: the model's calls parsed out of its text, and the grammar that enforces them.

The syntax (the checkpoint's chat template, and its public parsers: vLLM's `parser/gemma4.py`, transformers' gemma4
response template, xgrammar's `gemma_4` structural tag)::

    <|tool_call>call:NAME{key:VALUE,key:VALUE}<tool_call|>

VALUE is `<|"|>text<|"|>` (a string: no escapes, the `<|"|>` marker delimits it), a JSON number, `true`, `false`,
`null`, `{key:VALUE,...}` (unquoted keys) or `[VALUE,...]`. Calls may follow each other; text around them is the
message's content. The markers are special tokens of the release's tokenizer (`<|tool_call>` 48, `<tool_call|>` 49)
and the model ends its turn after its calls with `<|tool_response>` (id 50, one of the release's eos ids).

- `split_tool_calls(text)`: (content, calls) of a finished text; a span that does not parse stays content.
- `ToolCallScanner`: the same, incrementally over a growing text (streaming): content never retracted, each call
  reported once it closes.
- `tool_call_constraint(tools, choice)`: a `Constraint` of kind "structural_tag" whose text is one or more calls
  (`"required"`) or exactly one call of one function (`"named"`), the arguments valid under the function's JSON
  schema in Gemma4's argument style (xgrammar's `JSONSchemaFormat(style="gemma")`).

Errors: `ToolCallSyntaxError` (a malformed argument text, from `parse_arguments`); `ConfigError` naming `tools` for
a tool the grammar cannot enforce (`check_enforceable`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dgemma_compile.model.config import ConfigError
from dgemma_compile.inputs.constraint import Constraint

TOOL_CALL_START = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
STRING_DELIM = '<|"|>'
CALL_PREFIX = "call:"
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""Function names this server accepts (OpenAI's rule)."""
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_MARKERS = (TOOL_CALL_START, TOOL_CALL_END)


class ToolCallSyntaxError(ValueError):
    """An argument text that is not Gemma4's `{key:VALUE,...}` syntax."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's `name` and its `arguments` (a dict of JSON values)."""

    name: str
    arguments: dict

    def arguments_json(self) -> str:
        """The arguments as OpenAI sends them: a JSON object's text."""
        return json.dumps(self.arguments, ensure_ascii=False)


class _Args:
    """Recursive descent over Gemma4's argument syntax (`parse_arguments`)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def fail(self, what: str):
        raise ToolCallSyntaxError(f"tool call arguments: {what} at character {self.i} of {self.s[:80]!r}")

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def eat(self, c: str) -> bool:
        self.ws()
        if self.s.startswith(c, self.i):
            self.i += len(c)
            return True
        return False

    def obj(self) -> dict:
        if not self.eat("{"):
            self.fail("expected '{'")
        out: dict = {}
        if self.eat("}"):
            return out
        while True:
            self.ws()
            j = self.s.find(":", self.i)
            key = self.s[self.i:j].strip() if j >= 0 else ""
            if key.startswith(STRING_DELIM) and key.endswith(STRING_DELIM) and len(key) >= 2 * len(STRING_DELIM):
                key = key[len(STRING_DELIM):-len(STRING_DELIM)]
            if not key or any(c in key for c in "{}[],"):
                self.fail("expected a key and ':'")
            self.i = j + 1
            out[key] = self.value()
            if self.eat("}"):
                return out
            if not self.eat(","):
                self.fail("expected ',' or '}'")

    def arr(self) -> list:
        self.eat("[")
        out: list = []
        if self.eat("]"):
            return out
        while True:
            out.append(self.value())
            if self.eat("]"):
                return out
            if not self.eat(","):
                self.fail("expected ',' or ']'")

    def value(self) -> Any:
        self.ws()
        s = self.s
        if s.startswith(STRING_DELIM, self.i):
            j = s.find(STRING_DELIM, self.i + len(STRING_DELIM))
            if j < 0:
                self.fail("an unterminated string")
            v = s[self.i + len(STRING_DELIM):j]
            self.i = j + len(STRING_DELIM)
            return v
        if s.startswith("{", self.i):
            return self.obj()
        if s.startswith("[", self.i):
            return self.arr()
        j = self.i
        while j < len(s) and s[j] not in ",}]":
            j += 1
        raw = s[self.i:j].strip()
        if not raw:
            self.fail("expected a value")
        self.i = j
        if raw in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[raw]
        if _NUMBER.fullmatch(raw):
            return json.loads(raw)
        return raw  # a bare word: kept as a string (vLLM's parser does the same)


def parse_arguments(text: str) -> dict:
    """Gemma4's argument text `{key:VALUE,...}` -> a dict of JSON values (strings, numbers, booleans, null, lists,
    dicts). Raises ToolCallSyntaxError for anything else (trailing text included)."""
    p = _Args(text)
    out = p.obj()
    p.ws()
    if p.i != len(text):
        p.fail("text after the arguments")
    return out


def _call(body: str) -> ToolCall | None:
    """The call of the text between the markers (`call:NAME{...}`), or None where it does not parse."""
    if not body.startswith(CALL_PREFIX):
        return None
    rest = body[len(CALL_PREFIX):]
    brace = rest.find("{")
    name = rest[:brace] if brace >= 0 else ""
    if not NAME_RE.fullmatch(name):
        return None
    try:
        return ToolCall(name, parse_arguments(rest[brace:]))
    except ToolCallSyntaxError:
        return None


def _held(text: str) -> int:
    """Characters at the end of `text` that may begin `TOOL_CALL_START` (held back while streaming)."""
    for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return k
    return 0


class ToolCallScanner:
    """Tool calls of a growing text, for streaming: `push(text)` with the WHOLE text so far (each push extends the
    previous one) returns (content added, calls that closed); `finish(text)` the same for the final text, where an
    unclosed call is content. Content is never retracted: text that may begin a call is held back until it is known.
    The concatenated pushes give `split_tool_calls(final text)`."""

    def __init__(self):
        self.pos = 0  # characters of the text consumed (given as content or parsed into calls)
        self.calls: list[ToolCall] = []

    def push(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        new: list[ToolCall] = []
        while True:
            start = text.find(TOOL_CALL_START, self.pos)
            if start < 0:
                end = len(text) if final else len(text) - _held(text[self.pos:])
                content.append(text[self.pos:end])
                self.pos = max(self.pos, end)
                break
            stop = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
            if stop < 0:  # an open call: wait for its end (or give it as content at the end)
                content.append(text[self.pos:start])
                self.pos = start
                if final:
                    content.append(text[start:])
                    self.pos = len(text)
                break
            call = _call(text[start + len(TOOL_CALL_START):stop])
            end = stop + len(TOOL_CALL_END)
            if call is None:  # not a call: the span stays content, markers included
                content.append(text[self.pos:end])
            else:
                content.append(text[self.pos:start])
                new.append(call)
            self.pos = end
        self.calls += new
        return "".join(content), new

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        return self.push(text, final=True)


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the content: `text` without its calls, the calls in order) of a model's finished text."""
    return ToolCallScanner().finish(text)


# ---------------------------------------------------------------------------------------------------------------
# Enforcement: xgrammar's structural tag in Gemma4's argument style

_UNENFORCED = ("minLength", "maxLength")
"""JSON-schema keywords xgrammar's Gemma4 argument style drops (it warns and ignores them: a `<|"|>`-delimited string
is filtered for the markers, which it does not combine with length bounds). Refused where calls are enforced, since
the arguments would not be guaranteed to validate."""


def _walk(schema: Any, path: str):
    if isinstance(schema, Mapping):
        yield path, schema
        for k, v in schema.items():
            if isinstance(v, Mapping) and k in ("properties", "$defs", "definitions", "patternProperties"):
                for name, sub in v.items():
                    yield from _walk(sub, f"{path}.{k}.{name}")
            elif isinstance(v, (Mapping, list)) and k not in ("enum", "const", "default", "examples", "required"):
                yield from _walk(v, f"{path}.{k}")
    elif isinstance(schema, list):
        for j, sub in enumerate(schema):
            yield from _walk(sub, f"{path}[{j}]")


def check_enforceable(parameters: Any, name: str) -> None:
    """Raise ConfigError naming `name` (e.g. "tools[0].function.parameters") where the schema uses a keyword the
    grammar library cannot enforce in Gemma4's argument style (`_UNENFORCED`)."""
    for path, node in _walk(parameters, name):
        for k in _UNENFORCED:
            if k in node:
                raise ConfigError(path, f"{k!r} cannot be enforced in Gemma4's tool-call syntax by the grammar "
                                  f"library (xgrammar drops string length bounds there); remove it, or "
                                  f"bound the string with a \"pattern\" instead")


def _tag(function: Mapping):
    from xgrammar.structural_tag import JSONSchemaFormat, TagFormat

    params = function.get("parameters")
    schema = params if params is not None else {"type": "object", "properties": {}}
    return TagFormat(begin=TOOL_CALL_START + CALL_PREFIX + function["name"],
                     content=JSONSchemaFormat(json_schema=schema, style="gemma", max_whitespace_cnt=1,
                                              excludes=list(_MARKERS)),
                     end=TOOL_CALL_END)


def tool_call_constraint(functions: Sequence[Mapping], choice: str, *, parallel: bool = True) -> Constraint:
    """The constraint of an enforced tool choice over OpenAI function specs (`{"name", "parameters", ...}`, already
    validated): `choice` "required" -> one or more calls of any of them (exactly one when not `parallel`), nothing
    else; "named" -> exactly one call of `functions[0]`. Arguments: the function's `parameters` JSON schema in
    Gemma4's argument style, at most one whitespace character in a row, no call marker inside a string. The text
    then ends with eos (the grammar's stop token)."""
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

    if choice == "named":
        fmt = _tag(functions[0])
    elif choice == "required":
        fmt = TagsWithSeparatorFormat(tags=[_tag(f) for f in functions], separator="", at_least_one=True,
                                      stop_after_first=not parallel)
    else:
        raise ConfigError("tool_choice", f"only 'required' and a named function are enforced, got {choice!r}")
    return Constraint.structural_tag(StructuralTag(format=fmt).model_dump_json())

"""Tool calls on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` -> the template's tools, the
parse of the model's calls into OpenAI `tool_calls`, and the constraint that enforces a call (docs/constrained.md,
"Tool calls").

- `resolve_tools(tools, tool_choice, parallel_tool_calls)` validates the fields (every refusal a 400 naming the
  field, OpenAI's and vLLM's rules) into a `ToolRequest`: the tools the chat template renders, whether the answer
  is parsed for calls, and for "required" / a named function the `Constraint` that enforces them.
- `ToolAnswer`: one choice's answer, fed its engine events: the text with special tokens kept (vLLM decodes tool
  requests so, to see the markers), split into content and calls; `message()` for a response, `push()` the
  stream deltas.

tool_choice (vLLM's semantics): absent -> "auto" with tools, "none" without; "none": the tools are still rendered
(vLLM's default; its `--exclude-tools-when-tool-choice-none` is off) and the answer is NOT parsed (plain text, as
without tools); "auto": the model may call, the answer is parsed; "required": one or more calls, enforced (the text
is nothing but calls); {"type": "function", "function": {"name": N}}: exactly one call of N, enforced.
finish_reason "tool_calls" where calls were made and the model stopped by itself, except for a named function,
where OpenAI (and vLLM) report "stop"; "length" stays "length".
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dgemma_compile.model.config import ConfigError
from dgemma_compile.inputs.constraint import Constraint

from .protocol import APIError
from .tool_syntax import NAME_RE, ToolCall, ToolCallScanner, check_enforceable, tool_call_constraint

_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated tool fields. `tools`: the OpenAI tool specs for the chat template (None: no
    tools); `choice`: "none", "auto", "required" or "named" (`function` the named one); `parallel`: several calls
    allowed (`parallel_tool_calls`, default true); `constraint`: the enforcing `Constraint` ("required", "named")."""

    tools: list[dict] | None = None
    choice: str = "none"
    function: str | None = None
    parallel: bool = True
    constraint: Constraint | None = None

    @property
    def parse(self) -> bool:
        """Whether the answer is parsed for tool calls ("auto", "required", named)."""
        return self.tools is not None and self.choice != "none"


def _function(i: int, tool: Any) -> dict:
    at = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(at, 'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
    extra = set(tool) - {"type", "function"}
    if extra:
        raise _bad(at, f"unknown field(s) {sorted(extra)}")
    fn = tool["function"]
    extra = set(fn) - _FUNCTION_KEYS
    if extra:
        raise _bad(f"{at}.function", f"unknown field(s) {sorted(extra)}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _bad(f"{at}.function.name", f"must be 1-64 letters, digits, '_' or '-', got {json.dumps(name)[:70]}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{at}.function.description", "must be a string")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise _bad(f"{at}.function.parameters", 'must be a JSON schema of an object ({"type": "object", ...})')
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _bad(f"{at}.function.strict", "must be a boolean")
    return fn


def resolve_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest:
    """The `ToolRequest` of a chat request's `tools`, `tool_choice` and `parallel_tool_calls` (None: absent).
    Raises APIError (400 naming the field): a malformed tool, duplicate names, a tool_choice other than "none",
    "auto", "required" or {"type": "function", "function": {"name": N}}, "required" or a named one without tools,
    a name not among the tools, a schema the enforcing grammar cannot honour or compile."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls", "must be a boolean")
    parallel = parallel_tool_calls is not False
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", "must be a list of function tools")
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise _bad(f"tools[{i}].function.name", f"{n!r} is given twice")
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    function = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("tool_choice", 'a named tool choice is {"type": "function", "function": {"name": ...}}')
        function, choice = fn["name"], "named"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    else:
        raise _bad("tool_choice", f'must be "none", "auto", "required" or a named function, got '
                                  f"{json.dumps(tool_choice)[:60]}")
    if not functions:
        if choice in ("required", "named"):
            raise _bad("tool_choice", f"{json.dumps(tool_choice)[:60]} needs tools")
        return ToolRequest(choice=choice, parallel=parallel)
    constraint = None
    if choice == "named":
        if function not in names:
            raise _bad("tool_choice", f"function {function!r} is not among the tools ({', '.join(names)})")
        enforced = [functions[names.index(function)]]
    else:
        enforced = functions
    if choice in ("required", "named"):
        for f in enforced:
            try:
                check_enforceable(f.get("parameters"), f"tools[{names.index(f['name'])}].function.parameters")
            except ConfigError as e:
                raise APIError(400, str(e), param=e.param) from None
        constraint = tool_call_constraint(enforced, choice, parallel=parallel)
    return ToolRequest(tools=[{"type": "function", "function": f} for f in functions], choice=choice,
                       function=function, parallel=parallel, constraint=constraint)


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Chat messages for the template: an assistant's `tool_calls` with their `arguments` JSON text parsed into a
    dict (how chat templates render them), a tool message given the `name` of the call it answers (by
    `tool_call_id`) when it has none. Raises APIError naming the message for arguments that are not a JSON object."""
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = dict(c["function"])
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        args = None
                if not isinstance(args, dict):
                    raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments", "must be a JSON object's text")
                fn["arguments"] = args
                calls.append({**c, "function": fn})
                if c.get("id"):
                    names[c["id"]] = fn["name"]
            m["tool_calls"] = calls
        if m.get("role") == "tool" and not m.get("name") and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def _call_dict(call: ToolCall) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json()}}


@dataclass
class ToolAnswer:
    """One choice's answer under a parsing `ToolRequest`: `add(tokens)` per committed block, then `message()`
    (non-streaming) or `push()` per block (streaming). The text is the tokens decoded with special tokens KEPT (the
    markers are special tokens), the eos that ended the answer dropped."""

    tokenizer: Any
    request: ToolRequest
    eos_ids: frozenset
    ids: list[int] = field(default_factory=list)
    scanner: ToolCallScanner = field(default_factory=ToolCallScanner)
    sent: list[dict] = field(default_factory=list)
    held: str = ""  # streamed content held back while it is only whitespace
    shown: bool = False  # content other than whitespace was streamed

    def add(self, tokens: Sequence[int]) -> None:
        self.ids += [int(t) for t in tokens]

    def text(self, final: bool) -> str:
        ids = self.ids[:-1] if final and self.ids and self.ids[-1] in self.eos_ids else self.ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text if final else text.rstrip("\ufffd")  # an incomplete UTF-8 sequence may still change

    def _calls(self, calls: list[ToolCall]) -> list[dict]:
        if not self.request.parallel:
            calls = calls[:max(0, 1 - len(self.sent))]
        out = [_call_dict(c) for c in calls]
        self.sent += out
        return out

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" for calls made and an answer that ended by itself (not for a named
        function: "stop"), else the engine's, mapped."""
        reason = {"eos": "stop"}.get(engine_reason, engine_reason)
        if self.sent and reason == "stop" and self.request.choice != "named":
            return "tool_calls"
        return reason

    def message(self) -> tuple[str | None, list[dict] | None]:
        """(content, tool_calls) of the finished answer: content None where calls were made and nothing but
        whitespace is left around them (vLLM's rule)."""
        content, calls = self.scanner.finish(self.text(final=True))
        tool_calls = self._calls(calls)
        if tool_calls and not content.strip():
            return None, tool_calls
        return content, (tool_calls or None)

    def push(self, final: bool) -> tuple[str, list[dict]]:
        """The stream's next (content delta, tool-call deltas) after `add`: each call as OpenAI streams one, a first
        delta {index, id, type, function: {name, arguments: ""}} and then {index, function: {arguments}}. Content
        that is only whitespace so far is held back, and dropped where calls follow, so the joined deltas give
        `message()`."""
        content, calls = self.scanner.push(self.text(final), final=final)
        deltas = []
        for c in self._calls(calls):
            index = self.sent.index(c)
            deltas.append({"index": index, "id": c["id"], "type": "function",
                           "function": {"name": c["function"]["name"], "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": c["function"]["arguments"]}})
        if not self.shown:
            self.held += content
            content = ""
            if self.held.strip():
                content, self.held, self.shown = self.held, "", True
            elif final and not self.sent:
                content, self.held = self.held, ""
        return content, deltas

"""Bounds on the work one HTTP request can cause before it reaches the engine (`server.py` applies them).

- `BodyLimit`: an ASGI middleware refusing a body over `max_bytes` with 413 (an OpenAI-shaped error), from its
  Content-Length before reading it, or while it streams in (chunked bodies), so an oversized body is never buffered.
- `parse_json`: a body -> a JSON object, refusing malformed JSON, non-standard constants (NaN, Infinity) and nesting
  deeper than `MAX_DEPTH` with a 400 (a 100k-deep `[[[...` is a RecursionError inside `json.loads`, answered as a 500
  `text/plain` before this existed).
- `offload`: run CPU work (parsing a large body, tokenizing, rendering a chat template) in a worker thread with a
  time bound, so the event loop keeps serving `/health` and every stream while it runs; a body of at most
  `INLINE_BYTES` is worked on in place (a thread hop costs more than the work there: see `INLINE_BYTES`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from .protocol import APIError

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
"""`dgemma serve --max-body-bytes`'s default: 4 MiB (tokenizing that much text takes ~6 s on the demo tokenizer)."""
DEFAULT_INPUT_TIMEOUT_S = 30.0
"""`dgemma serve --input-timeout`'s default: seconds one request's parsing + tokenization may take."""
INLINE_BYTES = 4096
"""Bodies up to this size are parsed and tokenized on the event loop, not in a worker thread: the work is ~2 ms at
most (4 KiB through the demo tokenizer on this 2-core CPU; a typical request's ~0.5 ms), while each thread hop waits
for the GIL, which the engine thread holds for a whole compiled step (~10 ms at batch 16): two hops per request
cost `dgemma serve --max-batch 16` about a tenth of its c=16 throughput (bench/results/before_after_cpu_*.md)."""

MAX_DEPTH = 64
"""JSON nesting deeper than this is refused (the deepest valid request nests ~6 levels)."""


class BodyLimit:
    """ASGI middleware: HTTP bodies over `max_bytes` -> 413 {"error": {..., "code": "body_too_large"}}.

    A declared Content-Length over the limit is refused before the body is read; a chunked body is counted as it
    arrives and refused at the first chunk past the limit (the app never sees it). `on_refuse`: called for each
    refusal answered here (a metric)."""

    def __init__(self, app, max_bytes: int, on_refuse: Callable[[], None] | None = None):
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes: must be a positive integer, got {max_bytes}")
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self.error()  # the app's APIError handler answers it
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except APIError as e:  # raised in `counted` and not answered inside the app
            if e.status != 413 or started:
                raise
            await self._refuse(send)

    def error(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                             "(dgemma serve --max-body-bytes)", code="body_too_large")

    async def _refuse(self, send) -> None:
        if self.on_refuse is not None:
            self.on_refuse()
        body = json.dumps(self.error().body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _refuse_constant(name: str):
    raise APIError(400, f"malformed JSON body: {name} is not JSON (use a finite number)")


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of a parsed JSON value, stopping early past `limit` (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _unencodable(value: Any) -> str | None:
    """The path (`messages[0].content`) of the first string (value or key) in a parsed JSON value that is not
    Unicode text (a lone surrogate, which JSON's `\\ud800` escape can spell), or None (iterative)."""
    stack = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                name = k.encode("utf-8", "backslashreplace").decode()  # a key's own lone surrogate as \\udxxx
                stack.append((k, f"{path}.{name}" if path else name))
                stack.append((x, f"{path}.{name}" if path else name))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))
    return None


def parse_json(body: bytes) -> dict:
    """A request body -> its JSON object.

    Raises:
        APIError: 400 for malformed JSON or UTF-8, NaN / Infinity, nesting deeper than `MAX_DEPTH`, a non-object, a
            string that is not Unicode text (a lone surrogate escape such as "\\ud800"; `param` names its field).
    """
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, f"malformed JSON body: nested deeper than {MAX_DEPTH} levels") from None
    if _depth(value, MAX_DEPTH) > MAX_DEPTH:
        raise APIError(400, f"malformed JSON body: nested deeper than {MAX_DEPTH} levels")
    if not isinstance(value, dict):
        raise APIError(400, "the body must be a JSON object")
    bad = _unencodable(value)
    if bad is not None:
        bad = bad if len(bad) <= 100 else bad[:100] + "..."
        raise APIError(400, f"{bad}: a lone surrogate (e.g. \\ud800) is not Unicode text; send each character "
                            "whole (a surrogate pair)", param=bad, code="invalid_unicode")
    return value


async def offload(fn: Callable[..., T], *args, timeout: float, what: str, param: str | None = None,
                  size: int | None = None) -> T:
    """`fn(*args)` in a worker thread (`asyncio.to_thread`), bounded by `timeout` seconds; in place when `size` (the
    body's bytes, which bound the work) is at most `INLINE_BYTES`.

    Raises:
        APIError: 400 naming `param` (code "input_timeout") when `fn` runs past `timeout` (the thread finishes its
            work in the background, its result dropped); whatever `fn` raises, unchanged.
    """
    if size is not None and size <= INLINE_BYTES:
        return fn(*args)
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout)
    except TimeoutError:
        raise APIError(400, f"{param or 'body'}: {what} took longer than this server's bound of {timeout:g} s "
                            "(dgemma serve --input-timeout)", param=param, code="input_timeout") from None

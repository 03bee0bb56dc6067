"""An API key for `dgemma serve` (`--api-key`, or the environment variable `DGEMMA_API_KEY`; vLLM's `--api-key` /
`VLLM_API_KEY`).

`APIKeyAuth` is an ASGI middleware: a request to a protected path (`PROTECTED`: every `/v1` path, known or not, and
the tokenizer routes) must carry `Authorization: Bearer <key>`, compared in constant time (`hmac.compare_digest`
over the bytes); otherwise it is answered 401 with OpenAI's error shape and `WWW-Authenticate: Bearer`, before the
body is read or any route runs, streamed or not. `/health`, `/metrics`, `/openapi.json` and `/docs` stay open. The
key is never logged, echoed or put in an error.
"""

from __future__ import annotations

import hmac
import json

ENV = "DGEMMA_API_KEY"
PROTECTED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")
"""Paths that need the key, each with everything under it ("/v1" covers unknown /v1 paths too, so routes cannot be
probed without it)."""


def protected(path: str) -> bool:
    """Whether `path` (the ASGI scope's: percent-decoded, no query) needs the key."""
    return any(path == p or path.startswith(p + "/") for p in PROTECTED)


class Secret:
    """A key whose repr never shows it (Starlette's middleware list prints its options' reprs)."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "Secret(<hidden>)"


def _bearer(headers) -> bytes | None:
    """The token of the request's `Authorization: Bearer <token>` header (scheme case-insensitive), else None (no
    header, another scheme, no token)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


class APIKeyAuth:
    """ASGI middleware: `PROTECTED` paths need `Authorization: Bearer <api_key>` (see the module docstring).

    Raises:
        ValueError: at construction, an empty key.
    """

    def __init__(self, app, api_key: str | Secret):
        key = api_key.value if isinstance(api_key, Secret) else api_key
        if not key:
            raise ValueError("api_key: must be a non-empty string")
        self.app, self._key = app, key.encode("utf-8")

    def __repr__(self) -> str:  # never the key
        return "APIKeyAuth(api_key=<hidden>)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not protected(scope.get("path", "")):
            return await self.app(scope, receive, send)
        token = _bearer(scope.get("headers") or ())
        # compare_digest takes as long whatever the first differing byte (the length may show; the key's bytes not)
        if token is not None and hmac.compare_digest(token, self._key):
            return await self.app(scope, receive, send)
        missing = token is None
        body = json.dumps({"error": {
            "message": ("no API key given: send it as 'Authorization: Bearer <key>'" if missing else
                        "incorrect API key given"),
            "type": "invalid_request_error", "param": None,
            "code": "missing_api_key" if missing else "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

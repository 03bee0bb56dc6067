"""uvicorn's h11 protocol with a bound on the time a client may take to send a request's head, and OpenAI-shaped
bodies for the errors uvicorn answers itself.

uvicorn (0.55) has a keep-alive timeout between requests but none for a request's head: a client that opens a
connection and sends nothing, or half a header block, holds the connection (and its buffers) indefinitely; and its
keep-alive timer is cancelled by the first byte. `bounded_protocol(header_timeout_s)` gives an `H11Protocol` whose
connections must deliver each complete request head (request line and headers) within `header_timeout_s` seconds
of the connection opening or of the previous response ending; past it the server answers 408 `{"error": {...,
"code": "header_timeout"}}` and closes. A malformed request head is a 400 in the same shape (uvicorn's is text).
Use it as `uvicorn.Config(app, http=bounded_protocol(s))` (`dgemma serve --header-timeout`).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0
"""`dgemma serve --header-timeout`'s default: seconds a client has to send a request's head."""


def _error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response (connection: close) with an OpenAI-shaped error body."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def bounded_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> type[H11Protocol]:
    """An `H11Protocol` class bounding each request head's arrival to `header_timeout_s` seconds (see the module
    docstring).

    Raises:
        ValueError: `header_timeout_s` is not a positive number.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s: must be a positive number of seconds, got {header_timeout_s}")

    class BoundedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the head arrived (h11 leaves IDLE only on a whole head)
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's head

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.our_state is h11.IDLE:  # nothing of ours in flight: the 408 is a whole answer
                self.transport.write(_error(408, "Request Timeout",
                                            f"the request head did not arrive within {header_timeout_s:g} s "
                                            "(dgemma serve --header-timeout)", "header_timeout"))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            self._disarm()
            self.transport.write(_error(400, "Bad Request", f"malformed HTTP request: {msg}", "malformed_request"))
            self.transport.close()

    return BoundedH11Protocol

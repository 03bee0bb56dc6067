"""A Prometheus counter of the HTTP errors a server answers: `dgemma_http_errors_total{status}` (every 4xx and 5xx,
the API key's 401 and the body limit's 413 included; the header timeout's 408 is answered below the app, by
`transport.py`, and not counted), so an operator sees refusals by kind on /metrics.

`ErrorCounter` is an ASGI middleware; add it outermost (`app.add_middleware` last) with the `ServeMetrics` registry.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter

_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def error_counter(registry: CollectorRegistry) -> Counter:
    """The registry's `dgemma_http_errors` counter, made on first use (one per registry)."""
    counter = _COUNTERS.get(registry)
    if counter is None:
        counter = _COUNTERS[registry] = Counter("dgemma_http_errors", "HTTP error answers by status", ["status"],
                                                registry=registry)
    return counter


class ErrorCounter:
    """ASGI middleware counting each response whose status is >= 400 in `error_counter(registry)`."""

    def __init__(self, app, registry: CollectorRegistry):
        self.app, self.counter = app, error_counter(registry)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.counter.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:  # answered as a 500 by Starlette's ServerErrorMiddleware, which sits outside this one
            if not started:
                self.counter.labels("500").inc()
            raise

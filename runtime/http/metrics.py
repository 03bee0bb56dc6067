"""Prometheus metrics of a serving engine (`/metrics`, text format through prometheus-client).

Each `ServeMetrics` has its own registry (several engines in one process, e.g. tests, never collide). The engine
calls `iteration`, `block` and `request_done` from its thread; prometheus-client's metrics are thread-safe.

| metric                            | kind    | meaning                                                            |
|-----------------------------------|---------|--------------------------------------------------------------------|
| dgemma_queue_depth                | gauge   | requests waiting for a row                                          |
| dgemma_running_rows               | gauge   | rows serving a request (any phase)                                  |
| dgemma_iterations_total           | counter | engine iterations                                                   |
| dgemma_forwards_total             | counter | denoise forwards (one serves every denoising row)                  |
| dgemma_row_passes_total           | counter | decoder passes summed over rows                                     |
| dgemma_generated_tokens_total     | counter | generated non-pad tokens (`RequestStats.num_tokens`)               |
| dgemma_blocks_total               | counter | finished blocks                                                     |
| dgemma_requests_total{reason}     | counter | ended requests by finish reason (eos, length, stop, cancelled, error) |
| dgemma_tokens_per_second          | gauge   | generated tokens per second over the last `window_s` seconds        |
| dgemma_tokens_per_forward         | gauge   | generated tokens / row decoder passes (the field's metric)          |
| dgemma_steps_per_block            | gauge   | mean decoder passes per block                                       |
| dgemma_flag_read_seconds          | counter | seconds spent reading the step's [B, K] report (once per iteration) |
| dgemma_refused_total{limit}       | counter | requests refused, by the limit that refused them (its error code)  |
| dgemma_grammar_compiles_total{outcome} | counter | grammar requests: compiled, cached, error, refused             |
| dgemma_grammar_cache_bytes        | gauge   | bytes of compiled grammars kept (`--grammar-cache-bytes`)          |
| dgemma_grammar_workers            | gauge   | grammar worker processes alive (`--grammar-workers`)               |
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the server

REASONS = ("eos", "length", "stop", "cancelled", "error")


class ServeMetrics:
    """The engine's Prometheus metrics (see the module table); `text()` renders them."""

    def __init__(self, window_s: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.window_s = window_s
        self.queue_depth = Gauge("dgemma_queue_depth", "Requests waiting for a row", registry=r)
        self.running_rows = Gauge("dgemma_running_rows", "Rows serving a request", registry=r)
        self.iterations = Counter("dgemma_iterations", "Engine iterations", registry=r)
        self.forwards = Counter("dgemma_forwards", "Denoise forwards (each serves every denoising row)", registry=r)
        self.row_passes = Counter("dgemma_row_passes", "Decoder passes summed over rows", registry=r)
        self.tokens = Counter("dgemma_generated_tokens", "Generated non-pad tokens", registry=r)
        self.blocks = Counter("dgemma_blocks", "Finished blocks", registry=r)
        self.flag_read = Counter("dgemma_flag_read_seconds", "Seconds reading the step's per-row report", registry=r)
        self.requests = Counter("dgemma_requests", "Ended requests by finish reason", ["reason"], registry=r)
        for reason in REASONS:
            self.requests.labels(reason)
        self.refusals = Counter("dgemma_refused", "Requests refused, by the limit that refused them", ["limit"],
                                registry=r)
        self.grammars = Counter("dgemma_grammar_compiles", "Grammar requests by outcome", ["outcome"], registry=r)
        self.grammar_cache = Gauge("dgemma_grammar_cache_bytes", "Bytes of compiled grammars kept", registry=r)
        self.grammar_workers = Gauge("dgemma_grammar_workers", "Grammar worker processes alive", registry=r)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()
        self._totals = [0, 0, 0]  # tokens, row passes, blocks
        Gauge("dgemma_tokens_per_second", "Generated tokens per second over the recent window",
              registry=r).set_function(self.tokens_per_second)
        Gauge("dgemma_tokens_per_forward", "Generated tokens per row decoder pass",
              registry=r).set_function(lambda: self._totals[0] / max(self._totals[1], 1))
        Gauge("dgemma_steps_per_block", "Mean decoder passes per block",
              registry=r).set_function(lambda: self._totals[1] / max(self._totals[2], 1))

    def iteration(self, queue_depth: int, running: int, denoising: int, flag_read_s: float = 0.0) -> None:
        """One engine iteration: the queue and rows after it, whether it ran a denoise forward, and the seconds its
        read of the step's per-row report (`rows.Report`) took."""
        self.flag_read.inc(flag_read_s)
        self.queue_depth.set(queue_depth)
        self.running_rows.set(running)
        self.iterations.inc()
        if denoising:
            self.forwards.inc()

    def block(self, tokens: int, steps: int) -> None:
        """One finished block: its new non-pad tokens and its decoder passes."""
        self.tokens.inc(tokens)
        self.row_passes.inc(steps)
        self.blocks.inc()
        with self._lock:
            self._recent.append((time.monotonic(), tokens))
            self._totals[0] += tokens
            self._totals[1] += steps
            self._totals[2] += 1

    def refused(self, limit: str) -> None:
        """A request refused by `limit` (the refusal's error code, e.g. "grammar_timeout", "queue_full")."""
        self.refusals.labels(limit).inc()

    def grammar_compiled(self, outcome: str, cache_bytes: int, workers: int) -> None:
        """One grammar request's `outcome` ("compiled", "cached", "error", "refused"), and the cache and workers
        after it."""
        self.grammars.labels(outcome).inc()
        self.grammar_cache.set(cache_bytes)
        self.grammar_workers.set(workers)

    def request_done(self, reason: str) -> None:
        self.requests.labels(reason).inc()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            return sum(t for _, t in self._recent) / self.window_s

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

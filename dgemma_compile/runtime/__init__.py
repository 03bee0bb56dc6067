"""Serving DiffusionGemma: `engine.py` (continuous batching over one bucket's rows), `mixed_step.py` (one
mixed-phase forward per iteration), `protocol.py` (OpenAI request
and response bodies), `server.py` (FastAPI app: OpenAI-compatible routes, SSE), `metrics.py` (Prometheus).

`engine` needs only the core install; `server` and `metrics` need the `[serve]` extra (fastapi, uvicorn,
sse-starlette, prometheus-client) and are imported on use. `dgemma serve` (cli.py) puts them together.
"""

from .engine import BlockEvent, EagerBucket, Engine, EngineStats, QueueFullError, Request, build_engine
from .mixed_step import MixedBucket

__all__ = ["BlockEvent", "EagerBucket", "Engine", "EngineStats", "MixedBucket", "QueueFullError", "Request",
           "build_engine"]

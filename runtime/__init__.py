"""Serving DiffusionGemma: `engine.py` (continuous batching over one bucket's rows, one step per iteration at the
smallest batch size that holds them), `kv_memory.py` / `kv_pool.py` / `prefix_cache.py` (paged KV memory),
`protocol.py` (OpenAI request and response bodies), `server.py` (FastAPI app: OpenAI-compatible routes, SSE), `metrics.py` (Prometheus).

`engine` needs only the core install; `server` and `metrics` need the `[serve]` extra (fastapi, uvicorn,
sse-starlette, prometheus-client) and are imported on use. `dgemma serve` (cli.py) puts them together.
"""

from .engine import BlockEvent, Engine, EngineStats, QueueFullError, Request, build_engine

__all__ = ["BlockEvent", "Engine", "EngineStats", "QueueFullError", "Request", "build_engine"]

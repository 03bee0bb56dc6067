"""Serving DiffusionGemma (`dgemma_runtime`, the repository's top-level `runtime/`), a user of dgemma_compile's
public API (`row_table.RowTable` and its step, `driver.Driver`, `finish.finalize`, `requests.plan_requests`,
`compile.build`):
`engine.py` (continuous batching over one bucket's rows, one step per iteration at the smallest batch size that
holds them), `parallel.py` (its schedule source under tensor parallel: rank 0's, followed by the others),
`kv/memory.py` / `kv/pool.py` / `prefix_cache.py` (paged KV memory), `protocol.py` (OpenAI request and
response bodies), `limits.py` (bounded input work), `grammars.py` / `grammar_worker.py` (grammar compiles in
worker processes, bounded), `server.py` (FastAPI app: OpenAI-compatible routes, SSE),
`metrics.py` (Prometheus).

`engine` needs only the core install; `server` and `metrics` need the `[serve]` extra (fastapi, uvicorn,
sse-starlette, prometheus-client) and are imported on use. `dgemma serve` (dgemma_compile/cli/serve.py) puts them
together.
"""

from .engine import BlockEvent, Engine, EngineStats, QueueFullError, Request, build_engine

__all__ = ["BlockEvent", "Engine", "EngineStats", "QueueFullError", "Request", "build_engine"]

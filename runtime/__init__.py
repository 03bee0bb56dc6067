"""Serving DiffusionGemma (`dgemma_runtime`, the repository's top-level `runtime/`), a user of dgemma_compile's
public API (`row_table.RowTable` and its buckets' steps, `driver.Driver`, `finish.finalize`,
`requests.plan_requests`, `compile.build`):
`engine.py` (continuous batching over one row table, one step per iteration at the smallest bucket that holds its
busy rows), `parallel.py` (its schedule source under tensor parallel: rank 0's, followed by the others), `kv/`
(paged KV memory: the page pool, the prefix cache, image pages, admission), `http/` (the FastAPI app with its
OpenAI-compatible routes over `app.state`, the protocol's bodies, bounded input work, grammar compiles in worker
processes, tool calls, Prometheus metrics, OpenAPI, the API key).

`engine` needs only the core install; `http` needs the `[serve]` extra (fastapi, uvicorn, sse-starlette,
prometheus-client) and is imported on use. `dgemma serve` (dgemma_compile/cli/serve.py) puts them together.
"""

from .engine import BlockEvent, Engine, EngineStats, QueueFullError, Request, build_engine

__all__ = ["BlockEvent", "Engine", "EngineStats", "QueueFullError", "Request", "build_engine"]

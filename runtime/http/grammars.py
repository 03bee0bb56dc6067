"""Grammar compilation for the server, bounded and ending with its request (docs/serving.md, "Bounded work").

A request's constraint (`runtime/http/structured.py`) compiles in a worker process (`grammar_worker.py`), never in the
server's: xgrammar's compile is native code that cannot be interrupted, and some schemas (thousands of optional
properties) grow its memory by GBs for minutes. So:
- a constraint whose text is over `GrammarLimits.max_bytes` (`dgemma serve --max-grammar-bytes`) is refused before
  anything compiles (400, code "grammar_too_large");
- at most `workers` compiles run at once (`--grammar-workers`), each in its own process, which keeps the tokenizer
  info and is reused; a request waits for a free one within the server's input timeout (else 429, code
  "grammar_workers_busy");
- a compile past `timeout_s` (`--grammar-timeout`) kills its process (400, code "grammar_timeout"), and so does a
  request that ends while its grammar compiles (the client disconnected);
- a worker's address space is limited (RLIMIT_AS) to its size after start-up plus `memory_bytes`
  (`--grammar-memory`): a compile past it fails or kills the process (400, code "grammar_memory"), and the process
  is replaced;
- compiled grammars are kept in an LRU cache of at most `cache_bytes` (`--grammar-cache-bytes`, by xgrammar's
  `CompiledGrammar.memory_size_bytes`), so a repeated constraint compiles once.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass

from cachetools import LRUCache

from dgemma_compile.inputs.constraint import Constraint

from .grammar_worker import HEADER
from .protocol import APIError


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds of grammar compilation (module docstring); each is a `dgemma serve` flag."""

    max_bytes: int = 64 * 2**10
    """The longest constraint text (a schema's, a regex's, the choices' or a tool tag's JSON, UTF-8 bytes)."""
    timeout_s: float = 10.0
    """Seconds one compile may take."""
    memory_bytes: int = 2**30
    """Bytes of address space a worker's compiles may add to its size after start-up."""
    workers: int = 2
    """Worker processes (compiles at once)."""
    cache_bytes: int = 256 * 2**20
    """Bytes of compiled grammars kept (0: none)."""
    threads: int = 2
    """xgrammar threads per compile."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "memory_bytes", "workers", "threads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ValueError(f"cache_bytes: must be an integer >= 0, got {self.cache_bytes!r}")


def spec_bytes(constraint: Constraint) -> int:
    """The size of a constraint's text in UTF-8 bytes (what `GrammarLimits.max_bytes` bounds)."""
    spec = constraint.spec
    if spec is None:
        return 0
    if isinstance(spec, tuple):
        return sum(len(s.encode("utf-8", "surrogatepass")) + 1 for s in spec)
    return len(spec.encode("utf-8", "surrogatepass"))


class Worker:
    """One grammar worker process (`grammar_worker.py`) and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, setup: bytes, reaping: set) -> "Worker":
        """A started worker, ready; one that fails to get ready (or whose start is cancelled) is killed, its reap
        added to `reaping` (the service's, which `close` awaits)."""
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "dgemma_runtime.http.grammar_worker",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        w = cls(proc)
        try:
            if await w.ask(setup) != b"ready":
                raise RuntimeError("the grammar worker did not start")
        except BaseException:
            w.reap_into(reaping)
            raise
        return w

    def reap_into(self, reaping: set) -> None:
        """`kill`, the reaping task kept in `reaping` until it ends."""
        reap = self.kill()
        reaping.add(reap)
        reap.add_done_callback(reaping.discard)

    async def ask(self, data: bytes) -> bytes:
        """Send one frame, read the answer frame. Raises OSError / asyncio.IncompleteReadError when the process died."""
        self.proc.stdin.write(HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()
        n, = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        return await self.proc.stdout.readexactly(n)

    async def compile(self, constraint: Constraint) -> bytes:
        """The worker's answer (`grammar_worker` docstring). Raises OSError / asyncio.IncompleteReadError when the
        process died."""
        spec = list(constraint.spec) if isinstance(constraint.spec, tuple) else constraint.spec
        return await self.ask(json.dumps({"kind": constraint.kind, "spec": spec}).encode())

    def kill(self) -> asyncio.Future:
        """End the process (now) and reap it in the background: returns the reaping task (the service's `close`
        awaits it, so no process transport outlives the event loop)."""
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        return asyncio.ensure_future(self.proc.wait())


class GrammarService:
    """Compiles constraints in worker processes for one `GrammarLibrary` (the engine's tokenizer, vocabulary and
    eos ids), within `GrammarLimits`; `metrics`: a `metrics.ServeMetrics` (or None). Use from one event loop."""

    def __init__(self, library_factory, limits: GrammarLimits = GrammarLimits(), metrics=None):
        self.limits, self.metrics = limits, metrics
        self._library_factory = library_factory
        self.library = None
        self._setup: bytes | None = None
        self._idle: list[Worker] = []
        self._busy: set[Worker] = set()
        self._reaping: set[asyncio.Future] = set()  # killed workers' reaps, until they end
        self._slots: asyncio.Semaphore | None = None
        self.cache: LRUCache = LRUCache(maxsize=max(limits.cache_bytes, 1), getsizeof=lambda g: g.memory_size_bytes)

    @property
    def workers(self) -> int:
        """Worker processes alive (idle or compiling)."""
        return len(self._idle) + len(self._busy)

    def _count(self, outcome: str) -> None:
        """One grammar request's outcome in the metrics (its refusal is counted by the server's error handler)."""
        if self.metrics is not None:
            self.metrics.grammar_compiled(outcome, self.cache.currsize if self.limits.cache_bytes else 0,
                                          self.workers)

    async def compile(self, constraint: Constraint, field: str, wait_s: float):
        """xgrammar's `CompiledGrammar` of `constraint` (from the cache, or compiled by a worker); `field`: the
        request field it came from (named by refusals); `wait_s`: seconds to wait for a free worker.

        Raises:
            APIError: 400 naming `field`: the library cannot compile it (its reason), or a limit refused it (code
                "grammar_too_large", "grammar_timeout", "grammar_memory"); 429 (code "grammar_workers_busy") when no
                worker was free within `wait_s`.
            asyncio.CancelledError: the request ended; its compile's process was killed.
        """
        size = spec_bytes(constraint)
        if size > self.limits.max_bytes:
            self._count("refused")
            raise APIError(400, f"{field}: the grammar is {size} bytes, over this server's limit of "
                                f"{self.limits.max_bytes} (dgemma serve --max-grammar-bytes)", param=field,
                           code="grammar_too_large")
        hit = self.cache.get(constraint)
        if hit is not None:
            self._count("cached")
            return hit
        if self.library is None:
            self.library = await asyncio.to_thread(self._library_factory)
            self._setup = json.dumps({"info": self.library.info.serialize_json(),
                                      "memory_bytes": self.limits.memory_bytes,
                                      "threads": self.limits.threads}).encode()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.workers)
        try:
            await asyncio.wait_for(self._slots.acquire(), wait_s)
        except TimeoutError:
            self._count("refused")
            raise APIError(429, f"{field}: every grammar worker stayed busy for {wait_s:g} s (dgemma serve "
                                "--grammar-workers)", type="rate_limit_error", code="grammar_workers_busy") from None
        try:
            return await self._compile(constraint, field, wait_s)
        finally:
            self._slots.release()

    async def _compile(self, constraint: Constraint, field: str, wait_s: float):
        while self._idle and self._idle[-1].proc.returncode is not None:  # died idle (OOM killer, parent gone)
            self._idle.pop()
        if self._idle:
            worker = self._idle.pop()
        else:
            try:  # a new worker (Python, torch and xgrammar imports: ~2 s), within the wait's bound too
                worker = await asyncio.wait_for(Worker.start(self._setup, self._reaping), wait_s)
            except TimeoutError:
                self._count("refused")
                raise APIError(429, f"{field}: no grammar worker could start within {wait_s:g} s",
                               type="rate_limit_error", code="grammar_workers_busy") from None
        self._busy.add(worker)
        healthy = False
        try:
            answer = await asyncio.wait_for(worker.compile(constraint), self.limits.timeout_s)
            healthy = answer[:1] != b"m"
        except TimeoutError:
            self._count("refused")
            raise APIError(400, f"{field}: compiling the grammar took longer than this server's bound of "
                                f"{self.limits.timeout_s:g} s (dgemma serve --grammar-timeout)", param=field,
                           code="grammar_timeout") from None
        except (OSError, asyncio.IncompleteReadError):
            answer = b"m"  # the process died: the memory limit (or a crash inside the library)
        finally:
            self._busy.discard(worker)
            if healthy:
                self._idle.append(worker)
            else:
                worker.reap_into(self._reaping)
        kind, payload = answer[:1], answer[1:]
        if kind == b"m":
            self._count("refused")
            raise APIError(400, f"{field}: compiling the grammar needed more than this server's bound of "
                                f"{self.limits.memory_bytes} bytes (dgemma serve --grammar-memory)", param=field,
                           code="grammar_memory")
        if kind == b"e":
            self._count("error")
            raise APIError(400, f"{field}: {payload.decode()}", param=field)  # the constraint's problem
        import xgrammar as xgr

        # off the event loop: its time grows with the grammar (bounded by the worker's limits)
        grammar = await asyncio.to_thread(xgr.CompiledGrammar.deserialize_json, payload.decode(), self.library.info)
        if self.limits.cache_bytes and grammar.memory_size_bytes <= self.limits.cache_bytes:
            self.cache[constraint] = grammar
        self._count("compiled")
        return grammar

    async def close(self) -> None:
        """Kill every worker and wait for them to end (the server's shutdown), those killed earlier too."""
        workers = [*self._idle, *self._busy]
        self._idle.clear()
        self._busy.clear()
        await asyncio.gather(*(w.kill() for w in workers), *self._reaping)

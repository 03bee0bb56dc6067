"""The runner side: every system in its own long-lived worker, timed repeats interleaved round-robin.

`measure(payloads, repeats)` first prepares the systems one at a time (each loads its model, compiles and runs its
untimed warm-up pass in its own worker, alone on the machine), keeps every worker alive, then runs the timed
repeats round-robin: repeat 1 of every system in the given order, then repeat 2, ... . A slow minute on a noisy
machine then lands on every system alike instead of on whichever ran during it, and repeat i of two systems are
neighbours in time (the report's paired ratio uses that). `interleave=False` runs one system completely (prepare,
all repeats, result, exit) before the next starts: for models whose copies do not fit in memory together.

A worker is a `python -m bench.worker` child in its own session speaking JSON lines over its stdin/stdout (the
protocol is in `worker.py`), or, with `isolated=False`, a `worker.Worker` in this process behind the same calls.
Per system, the seconds spent waiting on its replies (prepare + repeats + result) are limited to `timeout_s`; a
timeout kills the worker's process group (its compile workers too), a crash or a failure reply makes the system's
row "n/a (reason)" with the log tail, and the other systems carry on. `budget_s` stops a system's repeats once its
timed passes add up to that many seconds (at least one runs). In-process workers have no timeout.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class WorkerProcess:
    """`python -m bench.worker` in its own session; `call(msg)` sends one request and waits for its reply."""

    def __init__(self, system: str, threads: int, timeout_s: float, deadline: float | None = None):
        self.system, self.timeout_s, self.used_s, self.closed = system, timeout_s, 0.0, False
        self.deadline = deadline  # time.perf_counter() after which no wait goes on (the whole run's time box)
        self.tmp = tempfile.TemporaryDirectory(prefix="dgemma_bench_")
        self.log_path = Path(self.tmp.name) / "worker.log"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.worker"], cwd=REPO, env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         start_new_session=True)
        self.replies: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)  # end of output: the worker exited

    def call(self, msg: dict) -> dict:
        """The worker's reply; a timeout or a dead worker becomes a failure reply (and the worker is killed)."""
        left = self.timeout_s - self.used_s
        start = time.perf_counter()
        by_deadline = self.deadline is not None and self.deadline - start < left
        if by_deadline:
            left = self.deadline - start
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.replies.get(timeout=max(left, 0.0))
        except queue.Empty:
            if by_deadline:
                return self._failed(f"timed out at the run's deadline (--deadline-s), after {self.used_s + left:.0f} s")
            return self._failed(f"timed out after {self.timeout_s:g} s")
        except OSError:  # the worker closed its stdin: it died
            line = None
        finally:
            self.used_s += time.perf_counter() - start
        if line is None:
            self._kill()
            return self._failed(f"worker exited with status {self.proc.returncode}")
        return json.loads(line)

    def _failed(self, reason: str) -> dict:
        """A failure reply with the log's tail; kills the worker."""
        detail = self.log_tail()
        self.close()
        return {"ok": False, "result": {"system": self.system, "status": f"n/a ({reason})", "detail": detail}}

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _kill(self) -> None:
        """SIGKILL the worker's process group, then reap the worker. Only while it is unreaped (returncode None):
        until then its pid, the group id, cannot belong to anyone else."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()

    def close(self) -> None:
        """Kill the worker's process group (the worker if it still runs, its compile workers), drop its log. Once
        only."""
        if self.closed:
            return
        self.closed = True
        self._kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.reader.join(timeout=10)  # the reader sees end of output, then its file can close
        if not self.reader.is_alive():
            self.proc.stdout.close()
        self.tmp.cleanup()


class WorkerInProcess:
    """A `worker.Worker` in this process behind the `WorkerProcess` interface (no timeout)."""

    def __init__(self, system: str):
        from .worker import Worker

        self.system, self.worker = system, Worker()

    def call(self, msg: dict) -> dict:
        return json.loads(json.dumps(self.worker.handle(msg)))  # the same round trip as over a pipe

    def close(self) -> None:
        self.worker = None
        gc.collect()


@dataclass
class _Slot:
    """One system's worker and what came back from it."""

    payload: dict
    worker: WorkerProcess | WorkerInProcess | None = None
    result: dict | None = None
    timed_s: float = 0.0

    @property
    def system(self) -> str:
        return self.payload["system"]

    @property
    def live(self) -> bool:
        return self.worker is not None

    def call(self, msg: dict) -> dict | None:
        """The reply, or None after recording the failure and closing the worker."""
        reply = self.worker.call(msg)
        if not reply.get("ok"):
            self.result = reply["result"]
            self.close()
            return None
        return reply

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


@dataclass
class Measurement:
    """Raw results in the order of the payloads, and `order`: (repeat index, system) of each timed repeat, in the
    order they ran."""

    results: list[dict]
    order: list[tuple[int, str]] = field(default_factory=list)


def measure(payloads: list[dict], repeats: int, *, interleave: bool = True, isolated: bool = True,
            timeout_s: float = 900, budget_s: float | None = None, deadline: float | None = None,
            log=print) -> Measurement:
    """Prepare every system, run `repeats` timed repeats of each (round-robin when `interleave`), collect results.
    `deadline` (a `time.perf_counter()` value): no wait on a worker goes past it (a system then fails as timed out,
    and the results so far come back)."""
    slots = [_Slot(p) for p in payloads]
    order: list[tuple[int, str]] = []
    try:
        for group in ([slots] if interleave else [[s] for s in slots]):
            for s in group:
                _prepare(s, isolated, timeout_s, log, deadline)
            for i in range(repeats):
                done = [_repeat(s, i, budget_s, order, log) for s in group]
                if any(done):
                    log(f"  repeat {i + 1}/{repeats}: " + ", ".join(d for d in done if d))
            for s in group:
                if s.live:
                    reply = s.call({"op": "result"})
                    if reply is not None:
                        s.result = reply["result"]
                    s.close()
    finally:  # an interrupt leaves no worker behind
        for s in slots:
            s.close()
    return Measurement(results=[s.result for s in slots], order=order)


def _repeat(s: _Slot, i: int, budget_s: float | None, order: list, log) -> str:
    """Timed repeat `i` of slot `s` unless it is out (failed, or over its budget); its log fragment or ""."""
    if not s.live or (budget_s is not None and s.timed_s > budget_s):
        return ""
    reply = s.call({"op": "repeat"})
    if reply is None:
        log(f"  {s.system}: {s.result['status']} (repeat {i + 1})")
        return ""
    s.timed_s += reply["seconds"]
    order.append((i, s.system))
    return f"{s.system} {reply['seconds']:.3g} s"


def _prepare(s: _Slot, isolated: bool, timeout_s: float, log, deadline: float | None = None) -> None:
    start = time.perf_counter()
    s.worker = WorkerProcess(s.system, s.payload["threads"], timeout_s, deadline) if isolated \
        else WorkerInProcess(s.system)
    reply = s.call({"op": "prepare", "payload": s.payload})
    took = time.perf_counter() - start
    if reply is None:
        log(f"  {s.system}: {s.result['status']} ({took:.0f} s)")
        return
    comp = reply.get("compile_s")
    log(f"  {s.system}: prepared and warmed up in {took:.0f} s" + (f" (compile {comp:.0f} s)" if comp else ""))

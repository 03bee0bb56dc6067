"""The worker side of the runner/worker protocol: one system's `Session`, driven one request at a time.

    python -m bench.worker        # requests on stdin, replies on stdout, one JSON object per line

Requests (runner -> worker), in this order:
- {"op": "prepare", "payload": {system, model: ModelSpec fields, workload: WorkloadSpec fields, device, dtype,
  threads, max_seq_len}}: load, compile, warm up (`session.Session`);
  reply {"ok": true, "prepare_s": wall seconds, "compile_s": seconds or null}.
- {"op": "repeat"} (any number of times): one timed pass; reply {"ok": true, "index", "seconds", "started"}.
- {"op": "result"}: reply {"ok": true, "result": the raw measurement}; the worker then exits.
Any failure replies {"ok": false, "result": {"system", "status": "n/a (reason)", "detail": traceback tail}} and the
worker exits; so does end of input. The runner enforces time limits (it kills the worker's process group).

Only protocol lines go to stdout: the worker moves its own fd 1 onto stderr at start (the runner keeps stderr in
a log file whose tail becomes the "detail" of a crash), so nothing a library prints can corrupt a reply.
`Worker.handle` is also what `--in-process` calls directly, so both modes share one protocol.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def failure(system: str, e: BaseException) -> dict:
    """The "n/a (reason)" raw result of a system that raised `e`."""
    first = (str(e).strip().splitlines() or [""])[0]
    reason = f"{type(e).__name__}: {first}"[:160]
    return {"system": system, "status": f"n/a ({reason})", "detail": traceback.format_exc()[-3000:]}


class Worker:
    """Holds one `Session` and answers protocol requests (dicts in, dicts out; never raises)."""

    def __init__(self):
        self.session = None
        self.system = "?"

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        try:
            if op == "prepare":
                return self._prepare(msg["payload"])
            if self.session is None:
                raise RuntimeError(f"{op!r} before a successful 'prepare'")
            if op == "repeat":
                return {"ok": True, **self.session.repeat()}
            if op == "result":
                return {"ok": True, "result": self.session.result()}
            raise ValueError(f"unknown request {op!r}")
        except Exception as e:  # noqa: BLE001 - a failing system is reported as n/a, never crashes the run
            return {"ok": False, "result": failure(self.system, e)}

    def _prepare(self, payload: dict) -> dict:
        import torch

        from . import models, workloads
        from .session import Session

        self.system = payload["system"]
        torch.set_num_threads(int(payload["threads"]))
        if payload.get("host_memory"):  # every system alike (`python -m bench --host-memory`)
            from dgemma_compile.cli.host_memory import retain_freed_memory

            retain_freed_memory()
        start = time.perf_counter()
        self.session = Session(self.system, models.ModelSpec(**payload["model"]),
                               workloads.WorkloadSpec(**payload["workload"]), payload["device"], payload.get("dtype"),
                               payload.get("max_seq_len"))
        return {"ok": True, "prepare_s": time.perf_counter() - start, "compile_s": self.session.compile_s}


def serve(requests, replies) -> None:
    """Answer JSON-line `requests` (an iterable of lines) on `replies` (a text file) until "result", a failure or
    the end of input."""
    worker = Worker()
    for line in requests:
        if not line.strip():
            continue
        msg = json.loads(line)
        reply = worker.handle(msg)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
        if not reply["ok"] or msg.get("op") == "result":
            return


def main() -> int:
    replies = os.fdopen(os.dup(1), "w")  # the protocol channel: the original stdout
    os.dup2(2, 1)  # everything else printed to fd 1 lands in the log
    serve(sys.stdin, replies)
    replies.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

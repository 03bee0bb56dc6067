"""The one way a bench script starts `dgemma serve`: `running_server(flags)`, a subprocess on a loopback port, ready
when its `/health` answers 200, stopped (SIGINT, then killed) on exit. Used by `bench.serve` (the load test),
`bench.clients` (the field's clients) and `bench.schemathesis` (the fuzzer); `bench.startup` times its own start, so
it keeps its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running `dgemma serve`: its base `url`, its process, how long it took to answer /health (`ready_s`, s)."""

    url: str
    proc: subprocess.Popen
    ready_s: float
    _log: object

    def log(self) -> str:
        """What the server wrote to stdout and stderr so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_server(flags: Sequence[str], *, port: int | None = None, timeout_s: float = 300.0,
                   env: dict[str, str] | None = None) -> Iterator[Server]:
    """`python -m dgemma_compile.cli serve --host 127.0.0.1 --port PORT *flags` (PORT: `port`, default a free one),
    its output kept in a temporary file (a pipe nobody reads could fill and block it), with `env` added to this
    process's environment. Yields once `/health` answers 200.

    Raises:
        SystemExit: the server exited, or did not answer within `timeout_s` seconds (its output's tail named).
    """
    port = free_port() if port is None else port
    url = f"http://{HOST}:{port}"
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_compile.cli", "serve", "--host", HOST, "--port", str(port),
                             *flags], stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    server = Server(url=url, proc=proc, ready_s=0.0, _log=log)
    try:
        t0 = time.perf_counter()
        while not _healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"dgemma serve exited ({proc.returncode}):\n{server.log()[-3000:]}")
            if time.perf_counter() - t0 > timeout_s:
                raise SystemExit(f"dgemma serve did not answer {url}/health within {timeout_s:g} s:\n"
                                 f"{server.log()[-3000:]}")
            time.sleep(0.3)
        server.ready_s = time.perf_counter() - t0
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()

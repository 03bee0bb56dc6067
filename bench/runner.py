"""Run one system for one workload: in a child process (default; a timeout and a crash become "n/a") or in this one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_isolated(payload: dict, timeout_s: float, log=print) -> dict:
    """`python -m bench.worker` in its own session (so a timeout kills its compile workers too)."""
    system = payload["system"]
    with tempfile.TemporaryDirectory(prefix="dgemma_bench_") as tmp:
        inp, out, err = Path(tmp) / "in.json", Path(tmp) / "out.json", Path(tmp) / "stderr.txt"
        inp.write_text(json.dumps(payload))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   OMP_NUM_THREADS=str(payload["threads"]))
        start = time.perf_counter()
        with open(err, "w") as ef:
            proc = subprocess.Popen([sys.executable, "-m", "bench.worker", str(inp), str(out)], cwd=REPO, env=env,
                                    stdout=ef, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                log(f"  {system}: timed out after {timeout_s:.0f} s")
                return {"system": system, "status": f"n/a (timed out after {timeout_s:.0f} s)", "detail": _tail(err)}
        took = time.perf_counter() - start
        if rc != 0 or not out.exists():
            log(f"  {system}: worker exited with status {rc}")
            return {"system": system, "status": f"n/a (worker exited with status {rc})", "detail": _tail(err)}
        result = json.loads(out.read_text())
        log(f"  {system}: {result.get('status')} ({took:.0f} s)")
        return result


def run_in_process(payload: dict, log=print) -> dict:
    from .worker import run_payload

    start = time.perf_counter()
    result = run_payload(payload)
    log(f"  {payload['system']}: {result.get('status')} ({time.perf_counter() - start:.0f} s, in-process)")
    return result


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""

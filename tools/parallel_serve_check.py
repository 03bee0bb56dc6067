"""50 requests through `dgemma serve --tensor-parallel-size N` against the single-process server (issue 28, item 3:
the vLLM 47424 class, hidden states turning NaN after a few requests at TP=4).

Starts `dgemma serve` (the compiled engine, default options, --threads 1 per rank) twice on loopback: once with
`--tensor-parallel-size N` (N gloo ranks started by the CLI), once as one process; sends the same requests to each
(the demo's held-out prompts, several at a time, mixed seeds, temperatures and budgets, each asking for the
log-probability of its tokens); checks that every answer of the tensor-parallel server is the single-process one
(text, finish reason, token count), that no log-probability is NaN or infinite and that they agree within float32
reduction-order error; writes a JSON results file.

    python tools/parallel_serve_check.py --world-size 2 --requests 50 --out results.json

Takes ~5-15 min on 2 shared cores (each server compiles its batch sizes on first use). Exit status 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dgemma_compile.demo import tasks as T  # noqa: E402
from dgemma_compile.parallel.launch import free_port  # noqa: E402

LOGPROB_ATOL = 1e-3  # float32 reduction order through the sharded layers: logits within 1e-4 (tests/parallel/test_parallel.py)


def _requests(n: int) -> list[dict]:
    out = []
    for i, (_task, prompt, _answer) in enumerate(T.make_split("heldout", n, 0, offset=0)):
        body = {"model": "dgemma-demo", "prompt": prompt, "seed": i % 7, "logprobs": 1,
                "max_tokens": (8, 16, 64)[i % 3]}
        if i % 5 == 4:
            body["temperature"] = 0.0
        out.append(body)
    return out


def _serve(world: int, max_batch: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "dgemma_compile.cli", "serve", "--port", str(port), "--threads", "1",
           "--max-batch", str(max_batch)]
    if world > 1:
        cmd += ["--tensor-parallel-size", str(world)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stderr=log, stdout=log, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 1800
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"server (world {world}) did not come up; see {log_path}")
        time.sleep(0.5)


def _run(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    def one(body: dict) -> dict:
        r = httpx.post(url + "/v1/completions", json=body, timeout=1800)
        r.raise_for_status()
        c = r.json()["choices"][0]
        return {"text": c["text"], "finish_reason": c["finish_reason"],
                "tokens": r.json()["usage"]["completion_tokens"],
                "logprobs": (c.get("logprobs") or {}).get("token_logprobs") or []}

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, bodies))
    return out, time.monotonic() - t0


def _answers(world: int, bodies: list[dict], a, tmp: Path) -> tuple[list[dict], float]:
    proc, url = _serve(world, a.max_batch, tmp / f"serve_{world}.log")
    try:
        return _run(url, bodies, a.concurrency)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=6, help="requests in flight at once")
    ap.add_argument("--max-batch", type=int, default=4, help="the servers' --max-batch")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"parallel_serve_check_{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    bodies = _requests(a.requests)
    tp, tp_s = _answers(a.world_size, bodies, a, tmp)
    one, one_s = _answers(1, bodies, a, tmp)
    bad_lp = [i for i, r in enumerate(tp) if any(v is None or not math.isfinite(v) for v in r["logprobs"])]
    differ = [i for i, (x, y) in enumerate(zip(tp, one))
              if (x["text"], x["finish_reason"], x["tokens"]) != (y["text"], y["finish_reason"], y["tokens"])]
    lp_diff = max((abs(u - v) for x, y in zip(tp, one) if len(x["logprobs"]) == len(y["logprobs"])
                   for u, v in zip(x["logprobs"], y["logprobs"]) if u is not None and v is not None), default=0.0)
    exact = sum(T.check(b["prompt"], r["text"]) for b, r in zip(bodies, tp) if r["finish_reason"] == "stop"
                or r["finish_reason"] == "eos")
    checks = {"no_nan_or_inf_logprobs": not bad_lp and all(r["logprobs"] or not r["tokens"] for r in tp), "answers_equal_single_process": not differ,
              "logprobs_within_atol": lp_diff <= LOGPROB_ATOL,
              "no_error_finish": all(r["finish_reason"] in ("stop", "length") for r in tp)}
    results = {"world_size": a.world_size, "requests": a.requests, "concurrency": a.concurrency,
               "max_batch": a.max_batch, "checks": checks, "requests_with_bad_logprobs": bad_lp,
               "requests_differing": differ, "max_abs_logprob_difference": lp_diff, "logprob_atol": LOGPROB_ATOL,
               "finish_reasons": {k: sum(r["finish_reason"] == k for r in tp) for k in {r["finish_reason"] for r in tp}},
               "tensor_parallel_wall_s": round(tp_s, 1), "single_process_wall_s": round(one_s, 1),
               "exact_match_of_finished": exact, "tokens": sum(r["tokens"] for r in tp),
               "logprobs_checked": sum(len(r["logprobs"]) for r in tp)}
    text = json.dumps(results, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m bench.serve`: a load test of `dgemma serve` on the demo model, beside offline `gen.generate`.

    OMP_NUM_THREADS=1 python -m bench.serve --concurrency 1,4,16,64 --duration 30 --max-batch 16

Starts `dgemma serve` (one compiled bucket of `--max-batch` rows) as a subprocess, then per concurrency level N runs
N clients (asyncio + httpx, non-streaming /v1/completions) for `--duration` seconds, each sending the demo's held-out
test prompts (`demo.tasks.make_split("heldout")`, prompt i with seed i, the checkpoint's generation config) one after
another. Requests started before the deadline are awaited (at most `--timeout` s); one that fails (non-200,
transport error) counts as failed, one that never answers as lost. Reports per level: requests, throughput (returned
tokens / s and requests / s over the window), p50 / p99 latency, tokens per forward (the server's /metrics over the
window: generated tokens / row decoder passes; and per bucket forward), exact-match of the answers (`tasks.check`)
and how many answers differ from the offline run of the same prompt and seed.

Offline baseline: the same prompts through `dg.build(model).generate` in batches of `--max-batch` on a bucket of the
same size (the same compile units), in this process, with the server idle; throughput = generated tokens / s.
Warm-up is excluded everywhere (the server compiles before it listens; one untimed request per level; the offline
generator compiles and runs one batch untimed). Results: markdown in bench/results/serve_{device}_{date}.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

import httpx

from . import environment
from .server import running_server

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "dgemma-demo"


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {k: _metric(text, f"dgemma_{k}") for k in ("generated_tokens_total", "row_passes_total", "forwards_total")}


async def _level(url: str, prompts: list[str], concurrency: int, duration: float, timeout: float) -> dict:
    """N clients for `duration` s; returns the level's measurements and the answers by prompt index."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await client.post("/v1/completions", json={"model": MODEL, "prompt": prompts[0], "seed": 0})  # warm-up
        before = await _metrics(client)
        counter = iter(range(10**9))
        latencies, tokens, answers = [], [], {}
        failed = lost = 0
        start = time.perf_counter()
        deadline = start + duration

        async def worker() -> None:
            nonlocal failed, lost
            while time.perf_counter() < deadline:
                i = next(counter)
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompts[i % len(prompts)],
                                                                   "seed": i % len(prompts)})
                except httpx.TimeoutException:
                    lost += 1
                    continue
                except httpx.TransportError:
                    failed += 1
                    continue
                if r.status_code != 200:
                    failed += 1
                    continue
                body = r.json()
                latencies.append(time.perf_counter() - t0)
                tokens.append(body["usage"]["completion_tokens"])
                answers[i] = body["choices"][0]["text"]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        after = await _metrics(client)
    latencies.sort()
    q = lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else float("nan")  # noqa
    gen_tokens = after["generated_tokens_total"] - before["generated_tokens_total"]
    return dict(concurrency=concurrency, requests=len(latencies), failed=failed, lost=lost, elapsed=elapsed,
                tok_s=sum(tokens) / elapsed, req_s=len(latencies) / elapsed, p50=q(0.5), p99=q(0.99),
                tpf=gen_tokens / max(after["row_passes_total"] - before["row_passes_total"], 1),
                tpbf=gen_tokens / max(after["forwards_total"] - before["forwards_total"], 1), answers=answers)


def _offline(prompts: list[str], batch: int, max_seq_len: int) -> tuple[dict, dict[int, str]]:
    """`gen.generate` over every prompt in batches of `batch` (bucket of that size); tokens/s and texts."""
    import torch

    import dgemma_compile as dg
    from dgemma_compile.compile import CompileOptions
    from dgemma_compile.demo import DEMO_MODEL
    from dgemma_compile.inputs.text import Detokenizer, encode_prompt

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    gen = dg.build(model, CompileOptions(batch_buckets=(batch,), max_seq_len=max_seq_len, fuse_commit=False))
    ids = [encode_prompt(tok, p, bos_token_id=model.config.bos_token_id) for p in prompts]
    gen.generate(ids[:batch], seed=list(range(batch)))  # compile + warm-up, untimed
    texts, tokens = {}, 0
    start = time.perf_counter()
    for s in range(0, len(ids), batch):
        out = gen.generate(ids[s:s + batch], seed=list(range(s, min(s + batch, len(ids)))))
        for k, seq in enumerate(out.sequences):
            d = Detokenizer(tok)
            d.push(seq)
            d.finish()
            texts[s + k] = d.text
        tokens += sum(st.num_tokens for st in out.stats)
    elapsed = time.perf_counter() - start
    return dict(tok_s=tokens / elapsed, req_s=len(ids) / elapsed, requests=len(ids)), texts


def main(argv: list[str] | None = None) -> int:
    from dgemma_compile.demo import tasks

    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,16", help="comma list of client counts")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    p.add_argument("--duration-64", type=float, default=None, help="seconds for levels >= 64 (default --duration)")
    p.add_argument("--max-batch", type=int, default=16, help="rows of the server's bucket (and the offline batch)")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--prompts", type=int, default=500, help="held-out test prompts cycled through")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as lost")
    p.add_argument("--suffix", default="", help="appended to the results file's name (serve_cpu_<date><suffix>.md)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    prompts = [q for _, q, _ in tasks.make_split("heldout", args.prompts, seed=0)]
    levels = [int(x) for x in args.concurrency.split(",")]
    load_start = environment.load_average()

    flags = ["--max-batch", str(args.max_batch), "--max-seq-len", str(args.max_seq_len), "--max-queue", "1024"]
    with running_server(flags, timeout_s=1800) as server:
        url, setup_s = server.url, server.ready_s
        rows = []
        for n in levels:
            duration = args.duration_64 if (n >= 64 and args.duration_64) else args.duration
            rows.append(asyncio.run(_level(url, prompts, n, duration, args.timeout)))
            r = rows[-1]
            print(f"c={n}: {r['requests']} req, {r['tok_s']:.1f} tok/s, p50 {r['p50']:.3f}s p99 {r['p99']:.3f}s, "
                  f"failed {r['failed']} lost {r['lost']}", file=sys.stderr)
        served = [ln for ln in server.log().splitlines() if "serving" in ln]
    offline, texts = _offline(prompts, args.max_batch, args.max_seq_len)
    offline_match = sum(tasks.check(prompts[i], t) for i, t in texts.items()) / len(texts)
    lines = [f"# dgemma serve load test: demo model, CPU ({environment.today()})", "",
             f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python -m bench.serve "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"- device: {environment.device_name('cpu')}; load average (1/5/15 min) at the start: {load_start}, at the end: "
             f"{environment.load_average()}",
             f"- versions: {environment.versions()}; commit {environment.git_commit()}",
             f"- server: `dgemma serve --max-batch {args.max_batch} --max-seq-len {args.max_seq_len}` (one compiled "
             f"bucket; up and compiled in {setup_s:.1f} s, excluded); clients: asyncio + httpx, non-streaming "
             f"/v1/completions, held-out prompt i with seed i, checkpoint config",
             f"- server's line: `{served[0] if served else '?'}`", "",
             "| clients | s | requests | failed | lost | tok/s | req/s | p50 s | p99 s | tok/fwd (row) | tok/fwd (bucket) "
             "| exact match | differs from offline | vs c=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = rows[0]["tok_s"] if rows else 1.0
    for r in rows:
        answers = r["answers"]
        match = sum(tasks.check(prompts[i % len(prompts)], t) for i, t in answers.items()) / max(len(answers), 1)
        differs = sum(t != texts[i % len(prompts)] for i, t in answers.items())
        lines.append(f"| {r['concurrency']} | {r['elapsed']:.0f} | {r['requests']} | {r['failed']} | {r['lost']} | "
                     f"{r['tok_s']:.1f} | {r['req_s']:.2f} | {r['p50']:.3f} | {r['p99']:.3f} | {r['tpf']:.2f} | "
                     f"{r['tpbf']:.2f} | {100 * match:.1f}% | {differs} | {r['tok_s'] / base:.2f}x |")
    lines += ["", f"Offline `gen.generate`, batches of {args.max_batch} on the same bucket size, {offline['requests']} "
              f"prompts: {offline['tok_s']:.1f} tok/s, {offline['req_s']:.2f} req/s, exact match "
              f"{100 * offline_match:.1f}%.", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"serve_cpu_{environment.today()}{args.suffix}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

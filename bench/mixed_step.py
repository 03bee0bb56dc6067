"""`python -m bench.mixed_step`: the serving engine over a bucket of 8 rows, stepping at batch sizes (1, 2, 4, 8) vs at
one size (8), side by side in one run on the demo model.

    OMP_NUM_THREADS=1 python -m bench.mixed_step --requests 16 --rounds 3
    OMP_NUM_THREADS=1 python -m bench.mixed_step --quick      # a smoke run: 8 requests, 1 round (compiles 5 steps)
    python -m bench.mixed_step --device cuda

Every iteration of an engine runs one forward, the bucket's compiled step (`mixed_step.mixed_step`), at the smallest of
its batch sizes that holds every busy row (`RowTable.size_for`): with sizes (1, 2, 4, 8) a lone request runs at batch 1,
with (8,) every iteration runs all 8 rows, idle ones included. Two compiled generators on the same model
(`CompileOptions(batch_buckets=...)`, 256 slots, the device's commit-fusion default), every size warmed before the
rounds (`gen.warmup(b)`, compile time reported apart), and an engine over each (`build_engine(generator=gen)`).
Per round, each engine in turn (interleaved, the order alternating between rounds) serves the same `--requests`
held-out demo prompts (prompt i, seed i, the checkpoint's generation config), driven by `Engine.step` until idle:

- concurrency 1: one request at a time (the next submitted when the previous finished and its row is free): wall
  seconds per request (median over requests and rounds) and iterations;
- concurrency 8: a closed loop of 8 requests in flight (a new one submitted as soon as one finishes, until none is
  left): tokens per second over the round's wall time.

Also: the median iteration (`Engine.step`) ms, iterations per batch size (`EngineStats.forwards_by_size`), answers
that differ between the engines (none expected where rows are batch-invariant, the CPU default) and recompiles
during the rounds. Results: markdown in bench/results/batch_sizes_{device}_{date}.md.

(This module once compared the engine's two-forward iteration with the mixed-phase one; the mixed step is now the
only step, so it compares batch sizes over it instead: bench/results/mixed_step_cpu_2026-12-01.md is that older run.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from . import environment

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = 8
ENGINES = {"batch sizes (1, 2, 4, 8)": (1, 2, 4, 8), "one size (8)": (8,)}


def _drive(engine, prompts, config, concurrency: int) -> dict:
    """Serve every prompt (prompt i, seed i) keeping `concurrency` requests in flight; every `step` timed. A request
    is submitted only while no row is held by a finished request (the engine may free a row one iteration after the
    request's last event), so at concurrency 1 each request runs alone, at batch 1 where that size exists."""
    from dgemma_runtime import Request

    st0 = dict(iterations=engine.stats.iterations, tokens=engine.stats.tokens,
               by_size=dict(engine.stats.forwards_by_size))
    pending = [Request(prompt=p, config=config, seed=i) for i, p in enumerate(prompts)]
    done: list = []
    inflight: list = []
    per_request: list[float] = []
    started: dict[int, float] = {}  # id(request) -> when it was submitted
    times: list[float] = []
    start = time.perf_counter()
    while pending or inflight or not engine.idle():
        while pending and len(inflight) < concurrency and engine.running <= len(inflight):
            req = pending.pop(0)
            started[id(req)] = time.perf_counter()
            inflight.append(engine.submit(req))
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        for req in [r for r in inflight if r.stats.finish_reason is not None]:
            inflight.remove(req)
            done.append(req)
            per_request.append(t1 - started[id(req)])
    wall = time.perf_counter() - start
    by_size = {b: n - st0["by_size"].get(b, 0) for b, n in engine.stats.forwards_by_size.items()
               if n != st0["by_size"].get(b, 0)}
    answers = {r.seed: r.sequence for r in done}
    return dict(wall=wall, tokens=engine.stats.tokens - st0["tokens"],
                iterations=engine.stats.iterations - st0["iterations"], iter_ms=1e3 * statistics.median(times),
                per_request=per_request, by_size=by_size, answers=[answers[i] for i in range(len(prompts))])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 1 round")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 8, 1
    torch.set_num_threads(1)

    import dgemma_compile as dg
    from dgemma_compile.compile import CompileOptions, build
    from dgemma_compile.demo import DEMO_MODEL, tasks
    from dgemma_runtime import build_engine
    from dgemma_compile.inputs.text import encode_prompt

    model, tok = dg.load(DEMO_MODEL, device=args.device), dg.load_tokenizer(DEMO_MODEL)
    texts = [q for _, q, _ in tasks.make_split("heldout", args.requests, seed=0)]
    prompts = [encode_prompt(tok, t, bos_token_id=model.config.bos_token_id) for t in texts]
    config = model.generation_config
    gens, engines, compile_s = {}, {}, {}
    for name, sizes in ENGINES.items():
        gen = build(model, CompileOptions(batch_buckets=sizes, max_seq_len=256))
        compile_s[name] = {b: gen.warmup(b, config) for b in sizes}
        gens[name], engines[name] = gen, build_engine(model, max_batch=ROWS, max_seq_len=256, generator=gen)
    fused = {name: gen.fuse_commit for name, gen in gens.items()}
    for engine in engines.values():  # warm-up, untimed
        _drive(engine, prompts[:ROWS], config, ROWS)
    modes = {"concurrency 1": 1, f"concurrency {ROWS}": ROWS}
    results = {(m, name): [] for m in modes for name in engines}
    for r in range(args.rounds):
        for m, c in modes.items():
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                results[(m, name)].append(_drive(engines[name], prompts, config, c))
    recompiles = {name: dict(e.recompiles()) for name, e in engines.items() if e.recompiles()}
    names = list(engines)
    ref = results[("concurrency 1", names[0])][0]["answers"]
    cmd = f"python -m bench.mixed_step --requests {args.requests} --rounds {args.rounds}" + (
        f" --device {args.device}" if args.device != "cpu" else "")
    lines = [f"# Serving engine: batch sizes (1, 2, 4, 8) vs one size (8) over a bucket of {ROWS} rows, demo model, "
             f"{environment.device_tag(args.device)} ({environment.today()})", "",
             f"`OMP_NUM_THREADS=1 {cmd}`", "",
             f"- device: {environment.device_name(args.device)}; load average at the end: {environment.load_average()}",
             f"- versions: {environment.versions()}; commit {environment.git_commit()}",
             f"- one compiled generator per engine, a bucket of {ROWS} rows, 256 slots, commit fusion "
             f"{'on' if any(fused.values()) else 'off'}; {args.requests} held-out demo prompts (prompt i, seed i), "
             f"the checkpoint's generation config; {args.rounds} interleaved rounds (medians); compile excluded: " +
             "; ".join(f"{name}: " + ", ".join(f"B{b} {s:.1f} s" for b, s in per.items())
                       for name, per in compile_s.items()),
             f"- recompiles during the rounds: {recompiles or 'none'}", "",
             "| load | engine | wall s | request s (median) | tok/s | iterations | iteration ms (median) | "
             "iterations by batch size | answers differing |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (m, name), rs in results.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        req_s = statistics.median(x for r in rs for x in r["per_request"])
        differ = sum(a != b for r in rs for a, b in zip(r["answers"], ref))
        sizes = ", ".join(f"B{b}: {n}" for b, n in sorted(rs[-1]["by_size"].items()))
        lines.append(f"| {m} | {name} | {med('wall'):.2f} | {req_s:.3f} | {med('tokens') / med('wall'):.1f} | "
                     f"{med('iterations'):.0f} | {med('iter_ms'):.2f} | {sizes} | {differ} |")
    lines.append("")
    one, many = names[1], names[0]
    for m in modes:
        wall = {n: statistics.median(r["wall"] for r in results[(m, n)]) for n in names}
        req = {n: statistics.median(x for r in results[(m, n)] for x in r["per_request"]) for n in names}
        lines.append(f"- {m}: {many} vs {one}: wall {wall[many] / wall[one]:.2f}x, request {req[many] / req[one]:.2f}x "
                     "(lower is better).")
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or RESULTS / f"batch_sizes_{environment.device_tag(args.device)}_{environment.today()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

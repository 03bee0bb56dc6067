"""`python -m bench.mixed_step`: the serving engine's iteration, two forwards (encoder pass + denoise step) vs one
mixed-phase forward vs that with commit fusion, side by side in one run on the demo model.

    OMP_NUM_THREADS=1 python -m bench.mixed_step --batch 8 --requests 32 --rounds 3
    python -m bench.mixed_step --device cuda    # on a GPU: does commit fusion pay there? (not yet run)

One compiled generator (bucket of `--batch` rows, no commit fusion) and two engines over that bucket's buffers:
`build_engine(mixed=False)` (the encoder and denoise units) and `build_engine(mixed=True)` (the mixed_step unit); a
second generator with commit fusion and its mixed engine (rows of 2C tokens).
Per round and workload, each engine in turn (interleaved) serves the same `--requests` held-out demo prompts (prompt i,
seed i, the checkpoint's config), "burst" (all submitted at once) and "staggered" (one submitted before each
iteration), driven by `Engine.step` until idle; every `step` call is timed.
Reports medians over rounds: wall seconds, tokens/s, iterations, forwards (compiled forward units run) per
iteration, median iteration ms, the per-iteration flag read and the host plan refreshes (mixed), answers that differ
between the engines, and recompiles during the rounds. Compile time is excluded (reported apart).
Results: markdown in bench/results/mixed_step_{device}_{date}.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from . import environment

RESULTS = Path(__file__).resolve().parent / "results"


def _round(engine, prompts, config, staggered: bool = False) -> dict:
    from dgemma_compile.runtime import Request

    st0 = {k: getattr(engine.stats, k) for k in ("iterations", "forwards", "encoder_forwards", "flag_reads",
                                                  "flag_read_s", "plan_refreshes", "refresh_s", "tokens")}
    pending = [Request(prompt=p, config=config, seed=i) for i, p in enumerate(prompts)]
    reqs = pending if staggered else [engine.submit(r) for r in pending]
    pending = list(pending) if staggered else []
    times = []
    start = time.perf_counter()
    while pending or not engine.idle():
        if pending:  # staggered arrivals: one new request per iteration
            engine.submit(pending.pop(0))
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    d = {k: getattr(engine.stats, k) - v for k, v in st0.items()}
    return dict(wall=wall, iter_ms=1e3 * statistics.median(times), tokens=d["tokens"], iterations=d["iterations"],
                forwards=d["forwards"] + d["encoder_forwards"], flag_us=1e6 * d["flag_read_s"] / max(d["flag_reads"], 1),
                refreshes=d["plan_refreshes"], refresh_ms=1e3 * d["refresh_s"] / max(d["plan_refreshes"], 1),
                answers=[r.sequence for r in reqs])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (where commit fusion is meant to pay)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import dgemma_compile as dg
    from dgemma_compile.compile import CompileOptions, build
    from dgemma_compile.demo import DEMO_MODEL, tasks
    from dgemma_compile.runtime import build_engine
    from dgemma_compile.text import encode_prompt

    model, tok = dg.load(DEMO_MODEL, device=args.device), dg.load_tokenizer(DEMO_MODEL)
    texts = [q for _, q, _ in tasks.make_split("heldout", args.requests, seed=0)]
    prompts = [encode_prompt(tok, t, bos_token_id=model.config.bos_token_id) for t in texts]
    gen = build(model, CompileOptions(batch_buckets=(args.batch,), max_seq_len=256, fuse_commit=False))
    t0 = time.perf_counter()
    engines = {"two forwards (encoder + denoise units)": build_engine(model, max_batch=args.batch, max_seq_len=256,
                                                                      generator=gen, mixed=False)}
    t1 = time.perf_counter()
    engines["one mixed-phase forward (mixed_step unit)"] = build_engine(model, max_batch=args.batch, max_seq_len=256,
                                                                        generator=gen, mixed=True)
    t2 = time.perf_counter()
    fused_gen = build(model, CompileOptions(batch_buckets=(args.batch,), max_seq_len=256, fuse_commit=True))
    engines["one mixed-phase forward, commit fusion (2C rows)"] = build_engine(
        model, max_batch=args.batch, max_seq_len=256, generator=fused_gen, mixed=True)
    t3 = time.perf_counter()
    compile_s = {"two": t1 - t0, "mixed": t2 - t1, "fused": t3 - t2}
    config = model.generation_config
    for engine in engines.values():  # warm-up round, untimed
        _round(engine, prompts[:args.batch], config)
    base = dict(gen.compiles) | dict(fused_gen.compiles)
    workloads = ("burst", "staggered")
    results = {(w, name): [] for w in workloads for name in engines}
    for _ in range(args.rounds):
        for w in workloads:
            for name, engine in engines.items():
                results[(w, name)].append(_round(engine, prompts, config, staggered=w == "staggered"))
    compiles = dict(gen.compiles) | dict(fused_gen.compiles)
    recompiles = {k: v - base.get(k, 0) for k, v in compiles.items() if v != base.get(k, 0)}
    names = list(engines)
    ref = results[("burst", names[0])][0]["answers"]
    lines = [f"# Serving iteration: two forwards vs one mixed-phase forward (unfused and fused), demo model, "
             f"{environment.device_tag(args.device)} ({environment.today()})", "",
             f"`OMP_NUM_THREADS=1 python -m bench.mixed_step --batch {args.batch} --requests {args.requests} "
             f"--rounds {args.rounds}`", "",
             f"- device: {environment.device_name(args.device)}; load average at the end: {environment.load_average()}",
             f"- versions: {environment.versions()}; commit {environment.git_commit()}",
             f"- compiled generators with one bucket of {args.batch} rows, 256 slots: one without commit fusion "
             f"(the two-forward and mixed engines), one with it (the fused engine: numerics of "
             f"`generate(fuse_commit=True)`); {args.requests} "
             f"held-out demo prompts (prompt i, seed i), burst: all submitted at once, staggered: one submitted per "
             f"iteration; each engine in turn, {args.rounds} rounds (medians); compile excluded: two units "
             f"{compile_s['two']:.1f} s, mixed unit {compile_s['mixed']:.1f} s, fused mixed unit "
             f"{compile_s['fused']:.1f} s",
             f"- recompiles during the rounds: {recompiles or 'none'}", "",
             "| arrivals | iteration | wall s | tok/s | iterations | forwards/iteration | iteration ms (median) | flag read us | "
             "host plan refreshes | refresh ms | answers differing from two-forward |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (w, name), rs in results.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        differ = sum(a != b for r in rs for a, b in zip(r["answers"], ref))
        lines.append(f"| {w} | {name} | {med('wall'):.2f} | {med('tokens') / med('wall'):.1f} | {med('iterations'):.0f} | "
                     f"{med('forwards') / med('iterations'):.2f} | {med('iter_ms'):.2f} | {med('flag_us'):.1f} | "
                     f"{med('refreshes'):.0f} | {med('refresh_ms'):.2f} | {differ} |")
    lines.append("")
    for w in workloads:
        two, mix, fused = (statistics.median(r["wall"] for r in results[(w, n)]) for n in names)
        it2, itm, itf = (statistics.median(r["iter_ms"] for r in results[(w, n)]) for n in names)
        lines.append(f"- {w}: mixed vs two forwards, wall {mix / two:.2f}x, median iteration {itm / it2:.2f}x; "
                     f"fused mixed vs mixed, wall {fused / mix:.2f}x, median iteration {itf / itm:.2f}x "
                     "(lower is better).")
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or RESULTS / f"mixed_step_{environment.device_tag(args.device)}_{environment.today()}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()

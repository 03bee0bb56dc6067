"""The vocabulary region skipped where no row samples (issue 39 item 1): `CompileOptions.skip_idle_vocabulary` on
against off, side by side.

    python -m bench.idle_vocabulary [--model demo|scaled] [--rounds 5] [--out bench/results]

Two compiled generators that differ only in `skip_idle_vocabulary`, taking turns for `--rounds` rounds over the
model's workloads (`bench.workloads`). `demo` (buckets of sizes 1 and 8): the demo's 8 held-out task prompts at batch
1 under the checkpoint's adaptive config, and the fixed workload (64-token prompts, 128 tokens out, 16 denoise steps a
block) at batch 1 and at batch 8. `scaled` (`bench.models`: the released proportions at a CPU size, vocabulary 16,384,
canvas 256, bf16; a bucket of size 1): the fixed workload at batch 1 with a 64-token and with a 1,024-token prompt
(256 tokens out, 16 steps): a long prompt is where prefill forwards, which sample nothing, are a large share.
Per workload: the forwards (compiled step calls) of one pass and how many of them sampled no row (prefill chunks,
unfused commits: on CPU each block of a lone request after the first begins with a commit-only forward), counted in an
untimed pass by reading each step's report; the wall time of the whole workload per variant (median and min over the
rounds, after one untimed warm-up pass each); their ratio; whether the tokens are equal. Also each generator's time to
make its steps (compile, or load from the compile cache).

Writes bench/results/idle_vocabulary[_scaled]_cpu_<date>.md and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import dgemma_compile as dg
from dgemma_compile.compile import CompileOptions, build
from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.step.rows import Report

from . import environment, models, workloads

VARIANTS = {"always": False, "skip": True}


def _workloads(name: str, model, tokenizer) -> dict[str, workloads.Workload]:
    cfg, gen_cfg = model.config, model.generation_config
    if name == "scaled":
        return {f"fixed b1 ({n} in, 256 out)": workloads.build(workloads.WorkloadSpec(prompt_len=n, output_len=256),
                                                               cfg, gen_cfg) for n in (64, 1024)}
    return {"adaptive b1 (demo tasks)": workloads.build(workloads.WorkloadSpec(kind="adaptive", n_prompts=8), cfg,
                                                         gen_cfg, tokenizer=tokenizer, demo_tasks=True),
            "fixed b1 (64 in, 128 out)": workloads.build(workloads.WorkloadSpec(prompt_len=64, output_len=128), cfg,
                                                          gen_cfg),
            "fixed b8 (64 in, 128 out)": workloads.build(workloads.WorkloadSpec(prompt_len=64, output_len=128,
                                                                                batch=8), cfg, gen_cfg)}


def _run(gen, wl: workloads.Workload) -> list[list[int]]:
    out = []
    for req in wl.requests:
        out += gen.generate(req.prompts, wl.config, seed=req.seeds).sequences
    return out


def _count(gen, wl: workloads.Workload) -> tuple[int, int]:
    """(forwards, forwards in which no row sampled) of one pass, each step's report read after it (untimed)."""
    counts = [0, 0]
    wrapped = []
    for row_table in gen.row_tables:
        for view in row_table.views():
            def counted(view=view, unit=view.step):
                unit()
                counts[0] += 1
                counts[1] += not bool(view.row_state.report[:, Report.STEPPED].any())
            wrapped.append((view, view.step))
            view.step = counted
    try:
        _run(gen, wl)
    finally:
        for view, step in wrapped:
            view.step = step
    return counts[0], counts[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle_vocabulary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("demo", "scaled"), default="demo")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model == "demo":
        model, tokenizer = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
        sizes, slots = (1, 8), 256
    else:
        model, tokenizer = dg.load(models.resolve("scaled").checkpoint), None
        sizes, slots = (1,), 2048
    wls = _workloads(args.model, model, tokenizer)
    gens, made = {}, {}
    for name, skip in VARIANTS.items():
        gens[name] = build(model, CompileOptions(batch_buckets=sizes, max_seq_len=slots, skip_idle_vocabulary=skip))
        t0 = time.perf_counter()
        for size in sizes:
            gens[name].warmup(size)
        made[name] = (time.perf_counter() - t0, gens[name].step_source)
    tokens, counts, times = {}, {}, {(w, v): [] for w in wls for v in VARIANTS}
    for w, wl in wls.items():
        for v, gen in gens.items():
            tokens[w, v] = _run(gen, wl)  # the untimed warm-up pass
        counts[w] = _count(gens["skip"], wl)
    for _ in range(args.rounds):
        for w, wl in wls.items():
            for v, gen in gens.items():
                t0 = time.perf_counter()
                _run(gen, wl)
                times[w, v].append(time.perf_counter() - t0)
    lines = ["# The vocabulary region skipped where no row samples (`CompileOptions.skip_idle_vocabulary`)", "",
             "`python -m bench.idle_vocabulary " + " ".join(argv) + f"`; the {args.model} model ({model.dtype}, "
             f"vocabulary {model.config.vocab_size}, canvas {model.config.canvas_length}), one thread; the variants "
             "take turns each round.", "",
             f"- commit {environment.git_commit()}; device: {environment.device_name('cpu')}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in environment.versions().items()),
             f"- steps made (sizes {sizes}): " + "; ".join(f"{v} {s:.1f} s ({src})" for v, (s, src) in made.items()),
             "", "| workload | forwards | no row sampled | always: median (min) s | skip: median (min) s | "
             "always / skip | tokens equal |", "|---|---|---|---|---|---|---|"]
    for w in wls:
        a, s = times[w, "always"], times[w, "skip"]
        n, idle = counts[w]
        lines.append(f"| {w} | {n} | {idle} ({idle / n:.0%}) | {statistics.median(a):.3f} ({min(a):.3f}) | "
                     f"{statistics.median(s):.3f} ({min(s):.3f}) | {statistics.median(a) / statistics.median(s):.2f}x"
                     f" | {tokens[w, 'always'] == tokens[w, 'skip']} |")
    lines += ["", f"- load average 1/5/15 min: {environment.load_average()} (at the end); finished {environment.now()}"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "" if args.model == "demo" else f"_{args.model}"
    (out / f"idle_vocabulary{tag}_cpu_{time.strftime('%Y-%m-%d')}.md").write_text(text)
    return 0 if all(tokens[w, "always"] == tokens[w, "skip"] for w in wls) else 1


if __name__ == "__main__":
    raise SystemExit(main())

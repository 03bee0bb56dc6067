"""`python -m bench.host_memory`: the compiled denoise step with glibc's default allocator behaviour and with freed
memory retained (`dgemma_compile.cli.host_memory.retain_freed_memory`, what the CLI does on CPU), side by side.

    python -m bench.host_memory --model scaled --rounds 4 --steps 30
    python -m bench.host_memory --model demo --rounds 4 --steps 300 --out bench/results/host_memory_demo_cpu_$(date +%F).md

Each (variant, round) is a fresh process (the allocator's state is per process): the model loaded, the size-1 view of
a compiled generator with one request mid-block (`bench.overhead.mid_request`; the step loaded from the compile
cache after the first process made it), `--steps` denoise steps timed one by one, and the minor page faults the
process took during them (`getrusage`). Rounds alternate the order of the variants. Reported: the median step, the
page faults per step, and the medians over rounds; tokens do not depend on the allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.environment import device_name, git_commit, load_average, publish, today, versions

REPO = Path(__file__).resolve().parents[1]
CODE = r"""
import json, resource, statistics, sys, time, torch
torch.set_num_threads(1)
said = "default"
if sys.argv[2] == "retain":
    from dgemma_compile.cli.host_memory import retain_freed_memory
    said = retain_freed_memory()
import dgemma_compile as dg
from bench import models
from bench.overhead import mid_request
from dgemma_compile.compile import CompileOptions
from dgemma_compile.demo import DEMO_MODEL
demo = sys.argv[1] == "demo"
model = dg.load(DEMO_MODEL if demo else models.resolve("scaled").checkpoint)
gen = dg.build(model, CompileOptions(batch_buckets=(1,), max_seq_len=256 if demo else 512))
gen.warmup(1)
request = mid_request(gen, model, 64 if demo else 256)
wall, faults = [], 0
with torch.no_grad():
    for _ in range(int(sys.argv[3])):
        request.ready()
        f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        request.view.step()
        wall.append(time.perf_counter() - t)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"said": said, "ms": 1e3 * statistics.median(wall), "faults": faults / len(wall)}))
"""


def run(model: str, variant: str, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    p = subprocess.run([sys.executable, "-c", CODE, model, variant, str(steps)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{model} {variant} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("demo", "scaled"), default="scaled")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="timed denoise steps per process")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = ("default", "retain")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            results[v].append(run(args.model, v, args.steps))
            print(r, v, results[v][-1], file=sys.stderr, flush=True)
    ms = {v: statistics.median(x["ms"] for x in rs) for v, rs in results.items()}
    faults = {v: statistics.median(x["faults"] for x in rs) for v, rs in results.items()}
    paired = statistics.median(d["ms"] / k["ms"] for d, k in zip(results["default"], results["retain"]))
    lines = [f"# Freed host memory retained or returned: the compiled step of `{args.model}` at batch 1 ({today()})", "",
             f"`python -m bench.host_memory --model {args.model} --rounds {args.rounds} --steps {args.steps}`", "",
             f"- device: {device_name('cpu')}, one thread; load average at the end: {load_average()}",
             f"- versions: {versions()}; commit {git_commit()}",
             f"- retain: {results['retain'][0]['said']}", "",
             "| variant | step ms (median over rounds) | page faults per step | per round (ms) |", "|---|---:|---:|---|"]
    for v in variants:
        per_round = ", ".join(format(x["ms"], ".1f") for x in results[v])
        lines.append(f"| {v} | {ms[v]:.2f} | {faults[v]:.0f} | {per_round} |")
    lines += ["", f"- default / retain: **{ms['default'] / ms['retain']:.2f}x** of the medians, {paired:.2f}x paired "
              "(the median over rounds of each round's ratio)"]
    publish(lines, args.out)


if __name__ == "__main__":
    main()

"""Where a cold compile of the demo's step goes, and what the compile cache removes.

    python -m bench.compile_cost [--batch-size 1] [--out FILE] [--no-write]

Three child processes, each with its own empty `TORCHINDUCTOR_CACHE_DIR` (and a `DGEMMA_CACHE_DIR`), each making the
step that serves `--batch-size` requests on the demo model (`gen.warmup`):
- `torch.compile` alone: `artifact_cache=False` and Inductor's own settings (parallel compile workers, precompiled
  headers): what a cold first answer cost before the compile cache (the 107.7 s of issue 35, on a quiet machine);
- `cache, cold`: the compile cache on and empty (what `dgemma` does now on a miss: one in-process compile whose
  artifact and C++ builds are stored; `compile/cpp_store.py` sets `compile_threads=1` on CPU);
- `cache, warm`: a new process with a fresh Inductor cache and the compile cache the previous row filled: the step is
  loaded (no Dynamo, no AOTAutograd, no Inductor codegen, no g++).
Per row: the wall time of `warmup`, torch's own phase timers (`torch._dynamo.utils.compile_times`, seconds summed
over the process: Dynamo's trace, AOTAutograd, Inductor's codegen), the g++ builds seen in this process (count and
seconds; `CppBuilder.build`), the CPU ISA probe (`VecISA.check_build`, a g++ build plus a dlopen subprocess), and the
steps compiled or loaded. Builds in Inductor's worker processes (the first row) are not seen by the patch: their
time is inside Inductor's codegen timer. Results go to bench/results/compile_cost_cpu_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = (("torch.compile alone", False), ("cache, cold", True), ("cache, warm", True))
PHASES = ("_compile.compile_inner", "OutputGraph.call_user_compiler", "create_aot_dispatcher_function",
          "compile_fx_inner", "GraphLowering.compile_to_module", "GraphLowering.codegen", "async_compile.wait",
          "PyCodeCache.load_by_key_path")

CHILD = r"""
import json, sys, time
from collections import defaultdict
import torch
from torch._inductor import cpu_vec_isa
from torch._inductor.cpp_builder import CppBuilder

builds = defaultdict(float); counts = defaultdict(int)
original_build, original_probe = CppBuilder.build, cpu_vec_isa.VecISA.check_build
def build(self):
    t = time.perf_counter(); original_build(self); builds["g++"] += time.perf_counter() - t; counts["g++"] += 1
def probe(self, code):
    t = time.perf_counter(); ok = original_probe(self, code)
    builds["isa probe"] += time.perf_counter() - t; counts["isa probe"] += 1
    return ok
CppBuilder.build, cpu_vec_isa.VecISA.check_build = build, probe

import dgemma_compile as dg
from dgemma_compile.demo import DEMO_MODEL
model = dg.load(DEMO_MODEL)
gen = dg.build(model, dg.CompileOptions(artifact_cache=json.loads(sys.argv[1])))
t = time.perf_counter()
gen.warmup(int(sys.argv[2]))
wall = time.perf_counter() - t
from torch._dynamo.utils import compile_times
names, values = compile_times(repr="csv", aggregate=True)
print(json.dumps({"wall_s": wall, "phases": dict(zip(names, map(float, values))), "builds_s": builds,
                  "builds": counts, "compiled": sum(gen.units.compiles.values()), "loaded": sum(gen.loads.values())}))
"""


def run_row(artifact_cache: bool, batch_size: int, dgemma_cache: Path, scratch: Path) -> dict:
    """One child process; returns its JSON report."""
    env = dict(os.environ, DGEMMA_CACHE_DIR=str(dgemma_cache),
               TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-", dir=scratch))
    env.pop("DGEMMA_CACHE", None)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(artifact_cache), str(batch_size)], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[tuple[str, dict]]) -> list[str]:
    cols = ["warmup s", *PHASES, "g++ builds (s)", "ISA probe (s)", "compiled", "loaded"]
    lines = ["| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, r in rows:
        ph = [f"{r['phases'][p]:.1f}" if p in r["phases"] else "-" for p in PHASES]
        gpp = f"{r['builds'].get('g++', 0)} ({r['builds_s'].get('g++', 0.0):.1f})"
        isa = f"{r['builds'].get('isa probe', 0)} ({r['builds_s'].get('isa probe', 0.0):.1f})"
        lines.append(f"| {name} | {r['wall_s']:.1f} | " + " | ".join(ph) + f" | {gpp} | {isa} | {r['compiled']} | "
                     f"{r['loaded']} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--note", default="", help="free text printed with the results (e.g. machine contention)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-cost-") as tmp:
        scratch = Path(tmp)
        for i, (name, cache) in enumerate(ROWS):
            dgemma_cache = scratch / ("off" if not cache else "cache")
            t = time.perf_counter()
            r = run_row(cache, args.batch_size, dgemma_cache, scratch)
            r["process_s"] = time.perf_counter() - t
            rows.append((name, r))
            print(f"{name}: warmup {r['wall_s']:.1f} s, process {r['process_s']:.1f} s", file=sys.stderr)
    date = datetime.date.today().isoformat()
    lines = [f"# Where a cold compile of the demo's step goes (batch {args.batch_size}), {date}", "",
             "`python -m bench.compile_cost` (bench/compile_cost.py: what each row is). torch's phase timers are "
             "seconds summed over the child process and nest (Dynamo's `compile_inner` holds the rest).", ""]
    if args.note:
        lines += [args.note, ""]
    lines += table(rows)
    lines += ["", "Child process wall time (imports and model load included): "
              + ", ".join(f"{n} {r['process_s']:.1f} s" for n, r in rows), ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        out = args.out or Path(__file__).parent / "results" / f"compile_cost_cpu_{date}.md"
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

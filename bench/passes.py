"""Our graph passes on and off (issue 13): the compiled step's time on denoise steps, and its transient memory at the
released vocabulary.

    python -m bench.passes time [--calls 200] [--rounds 5] [--out bench/results]
    python -m bench.passes memory [--out bench/results]

`time`: the demo model, one compiled generator with every pass (defaults), one with `CompileOptions.disabled_passes`
naming them all, and one with `sample_step_fusion` forced on at the demo's size (`sample_step_fusion_min_bytes=0`),
each with the size-1 view of its bucket set up mid-request (`overhead.MidRequest`: a 64-token prompt encoded, block 0
in flight; re-admitted, untimed, whenever the block ends), its step (`Bucket.step`) called `--calls` times per
round, each call a denoise step, the variants taking turns for `--rounds` rounds. Reports the median, p10 and p90 of
the unit call per variant, and whether the passes-on median lies inside the passes-off p10-p90 band (issue 13's CPU
target).

`memory`: a 2-layer model of the released width and vocabulary (hidden 2816, vocab 262,144, one sliding and one full
layer as released, 8 experts top-2 instead of 128 top-8 to keep CPU weights and compile small: the sampler region,
not the experts, is what is measured), bfloat16, random weights. Per (passes, batch) configuration, in a fresh
process: B requests (8-token prompts) admitted into the bucket's B rows, the compiled step of size B called once
(it compiles; the prefill iteration, which leaves every row DENOISE), then the transient memory of a second call, a
denoise step of every row (default settings: at the released vocabulary the fusion runs at every batch size): peak
resident memory during the call (VmHWM, reset through /proc/self/clear_refs) minus resident memory before it
(weights, KV cache, static buffers), as a multiple of the float32 logits' size (B x 256 x 262,144 x 4 bytes). glibc returns
freed blocks above its mmap threshold to the system; the child runs with MALLOC_MMAP_THRESHOLD_=131072 (fixed, not
glibc's sliding one), so every vocabulary-sized buffer is its own mapping and shows in RSS while it lives.

Writes bench/results/passes_cpu_<date>.md (time) and passes_memory_cpu_<date>.md (memory) and prints them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import dgemma_compile as dg
from dgemma_compile.compile import CompileOptions
from dgemma_compile.compile.passes import PASS_NAMES
from dgemma_compile.step.phases import Phase

from . import environment

def _describe() -> str:
    return "\n".join([f"- commit {environment.git_commit()}; device: {environment.device_name('cpu')}; torch threads "
                      f"{torch.get_num_threads()}",
                      "- versions: " + ", ".join(f"{k} {v}" for k, v in environment.versions().items()),
                      f"- load average 1/5/15 min: {environment.load_average()} (at the end); finished "
                      f"{environment.now()}"])


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=10)
    return q[0], statistics.median(xs), q[-1]


# ----- time --------------------------------------------------------------------------------------------------------
class Variant:
    """One compiled generator on the demo model (passes on or off) and its size-1 view, set up mid-request."""

    def __init__(self, model, label: str, disabled: tuple[str, ...], **options):
        from .overhead import mid_request

        self.label = label
        self.gen = dg.build(model, CompileOptions(batch_buckets=(1,), max_seq_len=256, disabled_passes=disabled,
                                                  **options))
        self.compile_s = self.gen.warmup(1)
        self.request = mid_request(self.gen, model)
        self.wall: list[float] = []

    def time_calls(self, n: int) -> None:
        step = self.request.view.step
        with torch.no_grad():
            for _ in range(n):
                self.request.ready()  # untimed: the row denoising (re-admitted once its block ended)
                t = time.perf_counter()
                step()
                self.wall.append(time.perf_counter() - t)


def time_table(calls: int, rounds: int) -> str:
    from dgemma_compile.demo import DEMO_MODEL

    torch.set_num_threads(1)
    model = dg.load(DEMO_MODEL)
    variants = [Variant(model, "passes on (default)", ()), Variant(model, "passes off", PASS_NAMES),
                Variant(model, "sample_step_fusion forced (min bytes 0)", (), sample_step_fusion_min_bytes=0)]
    for _ in range(rounds):
        for v in variants:
            v.time_calls(calls)
    matches = {v.label: {k: m.text() for k, m in v.gen.units.pass_matches.items()} for v in variants}
    rows = []
    for v in variants:
        p10, med, p90 = (x * 1e3 for x in _quantiles(v.wall))
        rows.append(f"| {v.label} | {med:.3f} | {p10:.3f} | {p90:.3f} | {v.compile_s:.1f} |")
    on, off, forced = (_quantiles(v.wall) for v in variants)
    inside = off[0] <= on[1] <= off[2]
    lines = [f"# Graph passes on vs off: the demo's compiled step on denoise steps, B=1 ({time.strftime('%Y-%m-%d')})",
             "",
             _describe(), "",
             f"`python -m bench.passes time --calls {calls} --rounds {rounds}`: {rounds} interleaved rounds of {calls} "
             "unit calls per variant (milliseconds per call).", "",
             "| variant | median | p10 | p90 | warm-up s |", "|---|---|---|---|---|", *rows, "",
             f"passes-on median / passes-off median: {on[1] / off[1]:.3f}; inside the passes-off p10-p90 band: "
             f"{'yes' if inside else 'no'}. Forced / off: {forced[1] / off[1]:.3f} (the op's CPU implementation is "
             "eager torch; at the demo's size it does not run by default, `CompileOptions.sample_step_fusion_min_bytes`).",
             "",
             "Pass matches per unit:", ""]
    for label, per_unit in matches.items():
        lines += [f"- {label}: " + "; ".join(f"{k} {t}" for k, t in sorted(per_unit.items()))]
    return "\n".join(lines) + "\n"


# ----- memory ------------------------------------------------------------------------------------------------------
MEMORY_CONFIGS = (("on", 1), ("off", 1), ("on", 8), ("off", 8))


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_child(passes: str, batch: int) -> dict:
    """In this process: compile the step of the 2-layer released-width model at `batch`, call it twice (a prefill
    iteration, then a denoise step of every row), measure the second call (see the module docstring)."""
    from dgemma_compile.model.config import FULL, SLIDING

    from .models import build_direct, full_config

    torch.set_num_threads(1)
    cfg = dataclasses.replace(full_config(), num_layers=2, layer_types=(SLIDING, FULL), head_dims=(256, 512),
                              num_kv_heads=(8, 2), num_experts=8, top_k_experts=2)
    model = build_direct(cfg, torch.device("cpu"), torch.bfloat16)
    gen = dg.build(model, CompileOptions(batch_buckets=(batch,), max_seq_len=512,
                                         disabled_passes=PASS_NAMES if passes == "off" else ()))
    config = model.generation_config.resolved(model.config)
    row_table = gen.row_table(config)
    view = row_table.view(batch)
    for row in range(batch):
        row_table.admit(row, [cfg.bos_token_id] + [3 + i for i in range(7)], config, row)
    view.refresh()
    t = time.perf_counter()
    with torch.no_grad():
        view.step()  # compiles; the prefill iteration: every row DENOISE after it
        compile_s = time.perf_counter() - t
        phases = set(view.row_state.phase.tolist())
        if phases != {int(Phase.DENOISE)}:
            raise RuntimeError(f"rows in phases {phases} after the prefill iteration, not all DENOISE")
        before = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        t = time.perf_counter()
        view.step()
        step_s = time.perf_counter() - t
        peak = _rss_kib("VmHWM")
    logits = batch * cfg.canvas_length * cfg.vocab_size * 4
    matches = {k: m.text() for k, m in gen.units.pass_matches.items()}
    return dict(passes=passes, batch=batch, transient_bytes=(peak - before) * 1024, logits_bytes=logits,
                step_s=step_s, compile_s=compile_s, held_bytes=before * 1024, matches=matches)


def memory_table() -> str:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    results = []
    for passes, batch in MEMORY_CONFIGS:
        out = subprocess.run([sys.executable, "-m", "bench.passes", "memory-child", passes, str(batch)], env=env,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if out.returncode:
            raise RuntimeError(f"memory child {passes} B={batch} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    gib = 2**30
    rows = [f"| {r['passes']} | {r['batch']} | {r['transient_bytes'] / gib:.2f} | {r['logits_bytes'] / gib:.2f} | "
            f"{r['transient_bytes'] / r['logits_bytes']:.2f} | {r['held_bytes'] / gib:.2f} | {r['step_s']:.1f} | "
            f"{r['compile_s']:.0f} |" for r in results]
    lines = [f"# The denoise step's transient memory, passes on vs off ({time.strftime('%Y-%m-%d')})", "",
             _describe(), "",
             "`python -m bench.passes memory`: 2 layers at the released width and vocabulary (hidden 2816, vocab "
             "262,144, one sliding + one full layer, 8 experts top-2), bfloat16, canvas 256; the second call of the "
             "compiled step (a denoise step of every row) in a fresh process per row (module docstring: how it is "
             "measured).", "",
             "| passes | B | transient GiB | float32 logits GiB | transient / logits | held before GiB | step s | "
             "compile s |", "|---|---|---|---|---|---|---|---|", *rows, "",
             "Target (issue 13): passes on, B=8, transient <= 1.1x the float32 logits.", "",
             "Pass matches: " + "; ".join(f"{r['passes']} B={r['batch']}: {r['matches']}" for r in results)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.passes", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("time")
    t.add_argument("--calls", type=int, default=200)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--out", default="bench/results")
    m = sub.add_parser("memory")
    m.add_argument("--out", default="bench/results")
    c = sub.add_parser("memory-child")
    c.add_argument("passes", choices=("on", "off"))
    c.add_argument("batch", type=int)
    args = ap.parse_args(argv)
    if args.what == "memory-child":
        print(json.dumps(memory_child(args.passes, args.batch)))
        return 0
    text = time_table(args.calls, args.rounds) if args.what == "time" else memory_table()
    name = "passes" if args.what == "time" else "passes_memory"
    out = Path(args.out) / f"{name}_cpu_{time.strftime('%Y-%m-%d')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench.step_profile`: where one compiled denoise step's time goes, kernel by kernel, grouped by what
each kernel does (issue 39: the vocabulary region, what the step rebuilds every iteration, wrapper overhead).

    python -m bench.step_profile --model scaled --steps 8
    python -m bench.step_profile --model demo --steps 50 --out bench/results/step_profile_demo_cpu_$(date +%F).md

One request in row 0 of the size-1 view of a compiled generator (`bench.overhead.mid_request`: a prompt encoded, its
block in flight), one thread, Inductor's per-kernel profiler on (`torch._inductor.config.cpp.enable_kernel_profile`:
every generated C++ kernel is one profiler event; it changes the compiled code, so the step is compiled apart from
the default one, under its own cache key) and `torch.profiler` over `--steps` denoise steps.
First the default step's median (compiled without the kernel profiler: the step users run), then the profiled
build's unprofiled median (the instrumentation's own cost), then each event's self time per step, then
the events grouped (`GROUPS`, by event name, first match wins):

- vocabulary region: the sampler's fused loops (the kernels of the `torch.cond` branch: Inductor names them without
  the main graph's `graph_0_` prefix); its two GEMMs (lm_head, self-conditioning product) are extern calls that
  carry no name of their own, counted with the other GEMMs;
- per-step rebuild: the plan's RoPE tables (cos / sin), its masks' block sparsity, the Philox streams (start
  canvas and step noise): what issue 39 item 2 asks to rebuild only where something changed;
- attention, routed experts, other GEMMs and fused kernels;
- wrapper: self time of the compiled graph's call and of the Python around it (argument handling, allocation, the
  C++ wrapper's shims; for an AOTInductor package, whose call has no event of its own, all of it is the self time
  of the call around it, the kernel profiler's own per-kernel cost included): what a CUDA graph replay removes on a
  GPU.

Writes the markdown report to `--out` when given and prints it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch._inductor import config as inductor_config

from bench.environment import device_name, git_commit, load_average, publish, today, versions

CALL = "step_profile::step"
GROUPS: tuple[tuple[str, str], ...] = (
    ("wrapper: the compiled graph's call (self)", r"^## Call CompiledFxGraph"),
    # a step loaded or compiled as an AOTInductor package has no "## Call CompiledFxGraph" event: the C++ wrapper's own
    # time (its shims, allocations, the kernel profiler's own events) is then the self time of the call around it
    ("wrapper: the call's own time (self: an AOTInductor package's C++ wrapper, and the Python around it)",
     "^" + re.escape(CALL) + "$"),
    ("per-step rebuild: RoPE tables", r"cos.*sin|sin.*cos"),
    ("per-step rebuild: mask block sparsity", r"constant_pad_nd|bitwise_not_eq_ge_gt_index"),
    ("vocabulary region: sampler loops", r"^cpp_fused"),
    ("attention (flex, with its fused prologue)", r"flex_attention"),
    ("routed experts", r"moe_experts|grouped_mm|^aten::mm$|topk|sort|cumsum|scatter_add|index_add|searchsorted|"
                       r"^aten::(select|slice|item|_local_scalar_dense|as_strided)$|dgemma::materialize$"),
    ("per-step rebuild: Philox streams", r"bitwise_xor"),  # after the experts: Inductor may fuse the Philox loop
    # into a kernel of the last layer's expert combine (the demo's step: C = 16, its 48 counters cost next to nothing)
    ("other GEMMs (attention projections, shared MLP, lm_head, self-conditioning product)",
     r"mm_out$|^aten::(mm|addmm|bmm)$"),
    ("other fused kernels", r"^graph_0_cpp_fused"),
)


def group_of(name: str) -> str:
    for label, pattern in GROUPS:
        if re.search(pattern, name):
            return label
    return "other"


def _built(dg, model, CompileOptions, seq: int):
    gen = dg.build(model, CompileOptions(batch_buckets=(1,), max_seq_len=seq))
    gen.warmup(1)
    return gen


def _time_steps(request, steps: int) -> list[float]:
    """Wall time of `steps` denoise steps of `request` (`bench.overhead.MidRequest`), one at a time."""
    wall: list[float] = []
    with torch.no_grad():
        for _ in range(steps):
            request.ready()
            t = time.perf_counter()
            request.view.step()
            wall.append(time.perf_counter() - t)
    return wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("demo", "scaled"), default="scaled")
    ap.add_argument("--steps", type=int, default=8, help="denoise steps profiled (and timed unprofiled)")
    ap.add_argument("--top", type=int, default=25, help="events listed one by one")
    ap.add_argument("--retain-host-memory", action="store_true",
                    help="keep freed host memory in the process first (`dgemma_compile.cli.host_memory`, as the CLI does)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    host = "as the C library decides"
    if args.retain_host_memory:
        from dgemma_compile.cli.host_memory import retain_freed_memory

        host = retain_freed_memory()
    import dgemma_compile as dg
    from bench import models
    from bench.overhead import mid_request
    from dgemma_compile.compile import CompileOptions
    from dgemma_compile.demo import DEMO_MODEL

    path, seq, prompt = ((DEMO_MODEL, 256, 64) if args.model == "demo"
                         else (models.resolve("scaled").checkpoint, 512, 256))
    model = dg.load(path)
    # the default step first (no kernel profiler compiled in: the step every user runs), for scale
    plain = mid_request(_built(dg, model, CompileOptions, seq), model, prompt)
    default_wall = _time_steps(plain, args.steps)
    inductor_config.cpp.enable_kernel_profile = True
    gen = dg.build(model, CompileOptions(batch_buckets=(1,), max_seq_len=seq))
    compile_s = gen.warmup(1)
    request = mid_request(gen, model, prompt)
    wall = _time_steps(request, args.steps)
    with torch.no_grad():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                request.ready()
                with torch.profiler.record_function(CALL):
                    request.view.step()

    events = list(prof.events())
    calls = [(e.time_range.start, e.time_range.end) for e in events if e.name == CALL]
    self_us: Counter = Counter()
    count: Counter = Counter()
    grouped: Counter = Counter()
    for e in events:
        if any(lo <= e.time_range.start <= hi for lo, hi in calls):
            self_us[e.name] += e.self_cpu_time_total / args.steps
            count[e.name] += 1 / args.steps
            grouped[group_of(e.name)] += e.self_cpu_time_total / args.steps
    total = sum(self_us.values())
    cfg = model.config
    lines = [f"# One compiled denoise step, kernel by kernel: `{args.model}` at batch 1 ({today()})", "",
             f"`python -m bench.step_profile --model {args.model} --steps {args.steps}"
             f"{' --retain-host-memory' if args.retain_host_memory else ''}`", "",
             f"- device: {device_name('cpu')}, one thread; load average at the end: {load_average()}",
             f"- versions: {versions()}; commit {git_commit()}",
             f"- model: vocabulary {cfg.vocab_size}, canvas {cfg.canvas_length}, hidden {cfg.hidden_size}, {model.dtype}; "
             f"`CompileOptions(batch_buckets=(1,), max_seq_len={seq})` with the kernel profiler compiled in "
             f"(step made in {compile_s:.0f} s); freed host memory: {host}",
             f"- the default step (no kernel profiler compiled in): median {1e3 * statistics.median(default_wall):.2f} "
             f"ms (min {1e3 * min(default_wall):.2f}); the step below, with the kernel profiler compiled in, unprofiled: "
             f"median {1e3 * statistics.median(wall):.2f} ms (min {1e3 * min(wall):.2f}); profiled, the events' self "
             f"time sums to {total / 1e3:.2f} ms a step", "",
             "| group | ms per step | share |", "|---|---:|---:|"]
    for label, us in grouped.most_common():
        lines.append(f"| {label} | {us / 1e3:.3f} | {100 * us / total:.1f}% |")
    lines += ["", f"The {args.top} largest events:", "", "| event | µs per step | share | calls per step |",
              "|---|---:|---:|---:|"]
    for name, us in self_us.most_common(args.top):
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| {short.replace('|', chr(92) + '|')} | {us:.1f} | {100 * us / total:.1f}% "
                     f"| {count[name]:.3g} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()

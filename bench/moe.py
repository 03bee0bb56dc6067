"""Routed-expert implementations side by side: why `kernels.moe.op.resolve_moe_impl` picks what it picks.

    OMP_NUM_THREADS=1 python -m bench.moe [--repeats 30] [--out bench/results]

For each shape (the demo model's at a 16- and a 128-token forward, the scaled model's at one 256-token canvas; the
scaled one in float32 and bfloat16), every implementation of `dgemma::moe_experts` as a compiled unit runs it:
through `UnitFactory(CompileOptions()).backend`, i.e. with `moe_decompositions` (the loop stays an opaque eager call,
the others are traced into Inductor's graph). Timed repeats are interleaved round-robin across implementations
(one call of each, then the next round), median and p90 per call; each output is checked against the loop
(float32 1e-5, bfloat16 the test suite's bound). "grouped" compiles only in bfloat16 (`torch._grouped_mm`'s meta
check); in float32 it is timed eagerly and marked so.

Writes bench/results/moe_cpu_<date>.md (with `--out`) and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dgemma_compile import kernels as ops
from dgemma_compile.compile.options import CompileOptions
from dgemma_compile.compile.units import UnitFactory, compile_isolated

from . import environment

# (label, tokens N, hidden D, experts E, top-k K, expert intermediate I, dtype)
SHAPES = (
    ("demo, B=1 (16 tokens)", 16, 128, 8, 2, 128, torch.float32),
    ("demo, B=8 (128 tokens)", 128, 128, 8, 2, 128, torch.float32),
    ("scaled, one canvas", 256, 512, 64, 4, 128, torch.float32),
    ("scaled, one canvas", 256, 512, 64, 4, 128, torch.bfloat16),
)
BF16_BOUND = 6 * torch.finfo(torch.bfloat16).eps  # tests/kernels/test_ops.py


def _inputs(N, D, E, K, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w, idx = torch.softmax(torch.randn(N, E, generator=g), -1).topk(K, -1)
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    return x.to(dtype), w, idx, gate_up.to(dtype), down.to(dtype)


def _fn(impl: str, compiled: bool):
    def f(x, w, idx, gate_up, down):
        return torch.ops.dgemma.moe_experts(x, w, idx, gate_up, [], down, [], impl, "none")
    if not compiled:
        return f
    return compile_isolated(f, fullgraph=True, dynamic=False,
                            backend=UnitFactory(CompileOptions(), "cpu").backend(f"moe_{impl}"))


def measure(shape, repeats: int) -> list[tuple[str, float, float, float]]:
    """[(implementation label, median µs, p90 µs, max |out - loop|)] for one shape."""
    _, N, D, E, K, I, dtype = shape
    args = _inputs(N, D, E, K, I, dtype)
    ref = _fn("loop", False)(*args).float()
    systems = []
    for impl in ops.MOE_IMPLS:
        compiled = not (impl == "grouped" and dtype != torch.bfloat16)
        systems.append((impl + ("" if compiled else " (eager)"), _fn(impl, compiled)))
    times: dict[str, list[float]] = {name: [] for name, _ in systems}
    errors = {}
    with torch.no_grad():
        for name, fn in systems:  # compile + warm up, one at a time
            for _ in range(2):
                out = fn(*args)
            errors[name] = (out.float() - ref).abs().max().item()
        for _ in range(repeats):  # interleaved
            for name, fn in systems:
                t0 = time.perf_counter()
                fn(*args)
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name, _ in systems:
        ts = sorted(times[name])
        rows.append((name, statistics.median(ts) * 1e6, ts[int(0.9 * (len(ts) - 1))] * 1e6, errors[name]))
    bound = 1e-5 if dtype == torch.float32 else BF16_BOUND * ref.abs().max().item()
    for name, *_, err in rows:
        if err > bound:
            raise AssertionError(f"{name}: max |out - loop| = {err:.3g} > {bound:.3g}")
    return rows


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=None, help="directory for moe_cpu_<date>.md")
    args = p.parse_args(argv)
    v = environment.versions()
    md = [f"# Routed experts (`dgemma::moe_experts`) per implementation, cpu ({environment.today()})", "",
          f"- command: python -m bench.moe --repeats {args.repeats}",
          f"- device: {environment.device_name('cpu')}; torch threads {torch.get_num_threads()}",
          f"- versions: python {v['python']}, torch {v['torch']}, dgemma_compile {environment.git_commit()}",
          f"- load average 1/5/15 min at start: {environment.load_average()}",
          "- per call of a compiled unit holding the op (Inductor, our decompositions; `loop` stays an opaque eager "
          "call), interleaved round-robin, one warm-up; ratio = dense / this (> 1: faster than dense)", ""]
    for shape in SHAPES:
        label, N, D, E, K, I, dtype = shape
        rows = measure(shape, args.repeats)
        dense = next(r[1] for r in rows if r[0] == "dense")
        md += [f"## {label}: N={N} tokens, D={D}, E={E}, K={K}, I={I}, {str(dtype).removeprefix('torch.')}", "",
               "| implementation | µs median | µs p90 | x dense | max abs diff vs loop |",
               "|---|---:|---:|---:|---:|"]
        md += [f"| {name} | {med:.0f} | {p90:.0f} | {dense / med:.2f} | {err:.1e} |" for name, med, p90, err in rows]
        md.append("")
    out = "\n".join(md)
    print(out)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"moe_cpu_{environment.today()}.md").write_text(out + "\n")
    return out


if __name__ == "__main__":
    main()

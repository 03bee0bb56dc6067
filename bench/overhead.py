"""Per-call overhead of the compiled step (issue 10 item 7): through Dynamo with guards evaluated, through Dynamo
with guards skipped, and direct calls of the compiled graph (the default).

    python -m bench.overhead [--calls 200] [--rounds 5] [--profiled-calls 100] [--out bench/results]
    python -m bench.overhead --quick      # a smoke run: 5 calls, 1 round, 5 profiled calls (still compiles 3 units)

The demo model, `build(model, CompileOptions(batch_buckets=(1,), max_seq_len=256, direct_calls=..., skip_guards=...))`,
`warmup(1)` (compile time reported apart), then the size-1 view of the bucket serving the demo's own generation config
(`gen.row_table(config).view(1)`) runs one request as the compiled generator would: admitted into row 0
(`RowTable.admit`), its 64-token prompt encoded by prefill iterations of the step, until the row is DENOISE. Then the
step (`Bucket.step`, one `CompiledUnit`) is timed call after call, each call one denoise step of that row; each
step advances the row, so before every timed call the row's phase is read (untimed) and, once its block has ended
(COMMIT, or FREE when the request ended), the request is admitted afresh and prefilled again (untimed), so that every
timed call is a denoise step at the same context (prompt + block 0). Three generators on the same model take turns in
interleaved rounds.

- unit call: median wall time of `view.step()` without a profiler (the step, as the compiled driver sees it);
- under torch.profiler (CPU activity), per call: the unit call (a `record_function` around it), the compiled graph
  (event "## Call CompiledFxGraph ...", Inductor's compiled module), guard evaluation ("TorchDynamo Cache Lookup");
  overhead = unit call - graph, per call, then the median. Each round profiles some calls of each variant right after
  its unprofiled ones, and shares are taken of the profiled unit call of the same calls: this machine's load moves
  step times by tens of percent within minutes, more than the profiler adds (one event per op, ~130 per step);
- Δ unit call: each variant's unprofiled median minus the direct one's (a profiler-free cross-check);
- micro costs: `applied(options)` (the config patches every call enters), `guards_skipped()`, and the fingerprint
  check made once per generate call;
- where the step's time goes: the profiled events inside the timed unit calls (the untimed re-admissions and
  prefill iterations left out), top 15 by self CPU time, per variant.

Writes bench/results/overhead_cpu_<date>.md and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import dgemma_compile as dg
from dgemma_compile.compile import CompileOptions, applied
from dgemma_compile.compile.units import guards_skipped
from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.step.phases import Phase

from . import environment

GRAPH = "## Call CompiledFxGraph"  # prefix: Inductor's compiled module call ("## Call CompiledFxGraph <key> ##")
GUARDS = "TorchDynamo Cache Lookup"  # Dynamo's cache lookup = guard evaluation of the unit's entries
CALL = "overhead::unit_call"
PROMPT_LEN = 64
# (label, direct_calls, skip_guards); the last one is the default
VARIANTS = (("Dynamo, guards evaluated", False, False), ("Dynamo, guards skipped", False, True),
            ("direct calls (default)", True, True))


class MidRequest:
    """The size-1 view of compiled generator `gen`'s bucket for the model's own generation config, with one request
    (a `prompt_len`-token prompt, seed 0) in row 0 kept in phase DENOISE (see the module docstring): `ready()` before
    each timed `view.step()`."""

    def __init__(self, gen, model, prompt_len: int = PROMPT_LEN):
        self.cfg = model.generation_config.resolved(model.config)
        self.row_table = gen.row_table(self.cfg)
        self.view = self.row_table.view(1)
        self.prompt = [model.config.bos_token_id] + [3 + i % 20 for i in range(prompt_len - 1)]
        self.admissions = 0
        self.ready()

    def phase(self) -> Phase:
        return Phase(int(self.view.row_state.phase[0]))

    def ready(self) -> None:
        """Untimed: make row 0 DENOISE (its block in flight): admit the request afresh if its block ended (COMMIT) or
        it ended (FREE), then run prefill iterations of the step until its prompt is encoded."""
        if self.phase() == Phase.DENOISE:
            return
        with torch.no_grad():
            if self.phase() != Phase.PREFILL:
                self.row_table.admit(0, self.prompt, self.cfg, 0)
                self.view.refresh()
                self.admissions += 1
            while self.phase() == Phase.PREFILL:
                self.view.step()
        if self.phase() != Phase.DENOISE:
            raise RuntimeError(f"row 0 is {self.phase().name} after its prefill, not DENOISE")


def mid_request(gen, model, prompt_len: int = PROMPT_LEN) -> MidRequest:
    """`MidRequest(gen, model, prompt_len)`: one request in row 0 of the size-1 view, its block 0 in flight."""
    return MidRequest(gen, model, prompt_len)


class Variant:
    """One compiled generator on the demo model and its size-1 view, set up mid-request."""

    def __init__(self, model, label: str, direct_calls: bool, skip_guards: bool):
        self.label = label
        self.gen = dg.build(model, CompileOptions(batch_buckets=(1,), max_seq_len=256, direct_calls=direct_calls,
                                                  skip_guards=skip_guards))
        self.compile_s = self.gen.warmup(1)
        self.request = mid_request(self.gen, model)
        self.view = self.request.view
        self.wall: list[float] = []

    def time_calls(self, n: int) -> None:
        with torch.no_grad():
            for _ in range(n):
                self.request.ready()
                t = time.perf_counter()
                self.view.step()
                self.wall.append(time.perf_counter() - t)

    def profiled(self, n: int):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                self.request.ready()
                with record_function(CALL):
                    self.view.step()
        return prof


def per_call(profs) -> dict[str, list[float]]:
    """Per unit call (µs): its wall time under the profiler, the graph's, the guard lookup's, and the rest."""
    out: dict[str, list[float]] = {"call": [], "graph": [], "guards": [], "overhead": []}
    for prof in profs:
        events = list(prof.events())
        calls = sorted((e for e in events if e.name == CALL), key=lambda e: e.time_range.start)
        inner = [e for e in events if e.name.startswith(GRAPH) or e.name == GUARDS]
        _per_call(calls, inner, out)
    if not out["call"] or not any(out["graph"]):
        raise RuntimeError(f"no {GRAPH!r} events inside the unit calls: this torch names its events differently")
    return out


def _per_call(calls, inner, out: dict[str, list[float]]) -> None:
    for c in calls:
        lo, hi = c.time_range.start, c.time_range.end
        mine = [e for e in inner if lo <= e.time_range.start <= hi]
        graph = sum(e.time_range.elapsed_us() for e in mine if e.name.startswith(GRAPH))
        guards = sum(e.time_range.elapsed_us() for e in mine if e.name == GUARDS)
        call = c.time_range.elapsed_us()
        out["call"].append(call)
        out["graph"].append(graph)
        out["guards"].append(guards)
        out["overhead"].append(call - graph)


def top_table(profs, n_calls: int, rows: int = 15) -> list[str]:
    """Markdown: the top `rows` events by self CPU time, per step, over all of a variant's profiles; only events that
    start inside a timed unit call (the `CALL` ranges), so the untimed re-admissions and prefill steps are left out."""
    self_us: dict[str, float] = {}
    counts: dict[str, int] = {}
    for prof in profs:
        events = list(prof.events())
        calls = [(e.time_range.start, e.time_range.end) for e in events if e.name == CALL]
        for e in events:
            if any(lo <= e.time_range.start <= hi for lo, hi in calls):
                self_us[e.name] = self_us.get(e.name, 0.0) + e.self_cpu_time_total
                counts[e.name] = counts.get(e.name, 0) + 1
    total = sum(self_us.values())
    lines = ["| event | self µs per step | % of self total | calls per step |", "|---|---:|---:|---:|"]
    for key in sorted(self_us, key=self_us.get, reverse=True)[:rows]:
        name = "unit call (Python around the compiled call)" if key == CALL else key.replace("|", "\\|")
        lines.append(f"| {name} | {self_us[key] / n_calls:.1f} | {100 * self_us[key] / total:.1f} "
                     f"| {counts[key] / n_calls:g} |")
    return lines


def micro(fn, n: int = 2000) -> float:
    """Median µs of `fn()` over n calls, in batches of 100."""
    times = []
    for _ in range(n // 100):
        t = time.perf_counter()
        for _ in range(100):
            fn()
        times.append((time.perf_counter() - t) / 100 * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="timed unit calls per variant per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--profiled-calls", type=int, default=50, help="unit calls under the profiler per variant per round")
    p.add_argument("--quick", action="store_true", help="smoke run: 5 calls, 1 round, 5 profiled calls")
    p.add_argument("--out", type=Path, default=environment.REPO / "bench" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.rounds, args.profiled_calls = 5, 1, 5
    torch.set_num_threads(1)
    started, load0 = environment.now(), environment.load_average()

    model = dg.load(DEMO_MODEL)
    variants = [Variant(model, label, direct, skip) for label, direct, skip in VARIANTS]
    profs: dict[str, list] = {v.label: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            v.time_calls(args.calls)
            profs[v.label].append(v.profiled(args.profiled_calls))

    opts = variants[-1].gen.options

    def enter_applied():
        with applied(opts):
            pass

    def enter_skipped():
        with guards_skipped():
            pass

    fingerprint = variants[-1].gen.fingerprint
    owners_check = variants[-1].view.step.check_owners
    costs = {"`applied(options)` enter+exit (every unit call)": micro(enter_applied),
             "`guards_skipped()` enter+exit (every call, skipping variant)": micro(enter_skipped),
             "`ModelFingerprint.check` (once per generate call)": micro(lambda: fingerprint.check(model), 200),
             "`CompiledUnit.check_owners` (once per generate call, per unit)": micro(owners_check, 200)}

    ms = lambda us: f"{us / 1e3:.3f}"  # noqa: E731
    lines = [f"# Per-call overhead of the compiled step, demo model, B=1, cpu ({environment.today()})", "",
             f"- command: python -m bench.overhead {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
             f"- checkpoint: {DEMO_MODEL} (float32, canvas {model.config.canvas_length}, vocabulary "
             f"{model.config.vocab_size}); each timed call a denoise step of one request in row 0 of the size-1 view "
             f"(`{variants[-1].view.name}`), prompt {PROMPT_LEN} tokens encoded, block 0 in flight, demo generation "
             f"config; requests admitted afresh (untimed) as blocks ended: " +
             ", ".join(f"{v.label} {v.request.admissions}" for v in variants),
             f"- device: {environment.device_name('cpu')}; torch threads {torch.get_num_threads()}",
             f"- versions: " + ", ".join(f"{k} {v}" for k, v in environment.versions().items()),
             f"- load average 1/5/15 min: {load0} at start, {environment.load_average()} at end "
             f"(shared machine: absolute times move by tens of percent between runs; compare within a run)",
             f"- started {started}, finished {environment.now()}",
             f"- timing: {args.rounds} interleaved rounds, each of {args.calls} unprofiled then {args.profiled_calls} "
             f"profiled (torch.profiler, CPU activity) calls per variant",
             f"- compile s (warmup, apart from every timing): " +
             ", ".join(f"{v.label} {v.compile_s:.1f}" for v in variants), "",
             "overhead = unit call - compiled graph (\"## Call CompiledFxGraph\"), per call under the profiler, "
             "median; guards = \"TorchDynamo Cache Lookup\" inside the call; % = of the profiled unit call (the same "
             "calls).",
             "",
             "| variant | unit call ms (median) | p10 / p90 | under profiler: call ms | graph ms | overhead ms | "
             "guards ms | overhead % of step | guards % of step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    medians = {}
    for v in variants:
        pc = per_call(profs[v.label])
        wall = [t * 1e6 for t in v.wall]
        q = statistics.quantiles(wall, n=10)
        step = statistics.median(wall)
        medians[v.label] = step
        med = {k: statistics.median(x) for k, x in pc.items()}
        lines.append(f"| {v.label} | {ms(step)} | {ms(q[0])} / {ms(q[-1])} | {ms(med['call'])} | {ms(med['graph'])} "
                     f"| {ms(med['overhead'])} | {ms(med['guards'])} | {100 * med['overhead'] / med['call']:.1f} "
                     f"| {100 * med['guards'] / med['call']:.1f} |")
    direct = VARIANTS[-1][0]
    lines += [""] + [f"Δ unit call ({label} - {direct}, unprofiled medians): {ms(medians[label] - medians[direct])} ms "
                     f"({100 * (medians[label] - medians[direct]) / medians[label]:.1f}% of that variant's step)."
                     for label, *_ in VARIANTS[:-1]]
    lines += ["", "| micro cost | µs |", "|---|---:|"]
    lines += [f"| {k} | {c:.1f} |" for k, c in costs.items()]
    for v in variants:
        lines += ["", f"## Where the step's time goes: {v.label} (top 15 by self CPU time, under the profiler)", ""]
        lines += top_table(profs[v.label], args.profiled_calls * args.rounds)
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"overhead_cpu_{environment.today()}.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

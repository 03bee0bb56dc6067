"""Intra-op threads for the demo main job: 1 and 2 threads and the default, idle and beside a busy process.

    python bench/threads.py [--runs 40] [--max-seconds 90] [--out bench/results]

The job is `dgemma generate "sort 3 1 2 9 5="` as the CLI runs it: the demo model, the compiled generator with one
bucket and a static cache rounded up to 256 slots, compiled (or loaded from Inductor's cache) before timing, seed 0.
Each cell runs in its own process (no OMP_NUM_THREADS; the thread count is set with torch.set_num_threads before
compiling, as the CLI does): `--threads 1`, `--threads 2`, and the default, which the worker chooses with
`dgemma_compile.cli.threads.recommended_threads` after the busy process started (so its /proc/stat sample sees it).
"Busy" is a spin loop in a subprocess this script starts and kills (bounded: it ends by itself after
--max-seconds + 30 minutes). The three cells of a condition are started one after another (each compiles, or loads
Inductor's cache, then waits), then take turns in rounds of 2 requests, so that a shared machine's drift spreads
over all of them, until each ran the request --runs times (fewer when --max-seconds runs out, at least 3); medians
are reported. The default must be within 1.5x of the best cell of its condition; the script exits 1 when
it is not.

Writes the markdown table to bench/results/threads_cpu_<date>.md and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "sort 3 1 2 9 5="
TOLERANCE = 1.5


class Cell:
    """One worker process serving one thread setting: loads, applies threads, compiles as the CLI does, then times
    requests on demand (`run(k)`), so that the cells of a condition can take turns (interleaved rounds average out
    the drift of a shared machine)."""

    def __init__(self, threads: str):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", threads], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()
        self.rates: list[float] = []
        self.ttfbs: list[float] = []
        self.walls: list[float] = []

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def run(self, k: int) -> None:
        self.proc.stdin.write(f"{k}\n")
        self.proc.stdin.flush()
        out = self._read()
        self.rates += out["tok_s"]
        self.ttfbs += out["ttfb_s"]
        self.walls += out["wall_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def summary(self) -> dict:
        return {**self.info, "runs": len(self.rates), "tok_s": statistics.median(self.rates),
                "ttfb_ms": 1e3 * statistics.median(self.ttfbs), "request_ms": 1e3 * statistics.median(self.walls)}


def worker(threads: str) -> None:
    """The worker side of `Cell`: prints one JSON line when ready, then one per request line ("k": run k requests)."""
    import warnings

    import torch

    sys.path.insert(0, str(REPO))
    import dgemma_compile as dg
    from dgemma_compile.demo import DEMO_MODEL
    from dgemma_compile.step.requests import plan_requests
    from dgemma_compile.inputs.text import encode_prompt
    from dgemma_compile.cli.threads import free_cpus, recommended_threads

    warnings.filterwarnings("ignore")
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    free = free_cpus()
    n = recommended_threads(model) if threads == "default" else int(threads)
    torch.set_num_threads(n)
    ids = encode_prompt(tok, PROMPT, bos_token_id=model.config.bos_token_id)
    config = model.generation_config
    slots = plan_requests(model, [ids], config, 0)[3]  # committed slots the request needs
    gen = dg.build(model, dg.CompileOptions(batch_buckets=(1,), max_seq_len=-(-slots // 256) * 256))
    compile_s = gen.warmup(1, config)
    out = gen.generate([ids], config, seed=0)
    print(json.dumps({"threads": n, "free_cpus": free, "compile_s": compile_s,
                      "text": tok.decode(out.sequences[0], skip_special_tokens=True)}), flush=True)
    for line in sys.stdin:
        rates, ttfbs, walls = [], [], []
        for _ in range(int(line)):
            first: list[float] = []
            start = time.perf_counter()
            out = gen.generate([ids], config, seed=0, on_block=lambda *_: first or first.append(time.perf_counter()))
            wall = time.perf_counter() - start
            rates.append(out.stats[0].num_tokens / wall)
            ttfbs.append(first[0] - start)
            walls.append(wall)
        print(json.dumps({"tok_s": rates, "ttfb_s": ttfbs, "wall_s": walls}), flush=True)


def measure(runs: int, max_seconds: float) -> dict[str, dict]:
    """The three cells of one condition, started one after another (the default samples the CPUs while the others
    wait idle), then timed in interleaved rounds of a few requests until `runs` each or `max_seconds` (>= 3 each)."""
    cells: dict[str, Cell] = {}
    try:
        for threads in ("1", "2", "default"):
            cells[threads] = Cell(threads)
        deadline = time.perf_counter() + max_seconds
        order = list(cells.values())
        per_round = 2
        while min(len(c.rates) for c in order) < runs and (
                min(len(c.rates) for c in order) < 3 or time.perf_counter() < deadline):
            for c in order:
                c.run(min(per_round, runs - len(c.rates)) or 1)
            order = order[1:] + order[:1]
        return {t: c.summary() for t, c in cells.items()}
    finally:
        for c in cells.values():
            c.close()


def load_average() -> str:
    try:
        return " / ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def machine() -> str:
    name = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} logical CPUs)"


def versions() -> str:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return f"python {platform.python_version()}, torch {torch.__version__}, dgemma_compile {commit} (+ working tree)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=40, help="requests per cell (median reported)")
    p.add_argument("--max-seconds", type=float, default=90.0, help="time budget per condition after compiling")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="directory of the markdown table")
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0

    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = load_average()
    cells: dict[str, dict[str, dict]] = {}
    for condition in ("idle", "busy"):
        spin = None
        if condition == "busy":
            bound = args.max_seconds + 1800  # three cells compiled, then timed: ends by itself if never killed
            spin = subprocess.Popen([sys.executable, "-c",
                                     f"import time\nt = time.time() + {bound}\nwhile time.time() < t: pass"])
            time.sleep(1.0)
        try:
            cells[condition] = measure(args.runs, args.max_seconds)
            for threads, cell in cells[condition].items():
                print(f"{condition} threads={threads}: {cell['tok_s']:.1f} tok/s ({cell['runs']} runs, "
                      f"{cell['threads']} threads, {cell['free_cpus']} CPUs free at start)", file=sys.stderr)
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
    finished = datetime.datetime.now(datetime.timezone.utc)

    rows, verdicts, ok = [], [], True
    for condition, by in cells.items():
        best = max(c["tok_s"] for c in by.values())
        for threads, c in by.items():
            label = f"default ({c['threads']})" if threads == "default" else threads
            free = "-" if c["free_cpus"] is None else f"{c['free_cpus']:.2f}"
            rows.append(f"| {condition} | {label} | {c['tok_s']:.1f} | {c['ttfb_ms']:.1f} | {c['request_ms']:.1f} | "
                        f"{best / c['tok_s']:.2f}x | {c['runs']} | {free} | {c['compile_s']:.1f} | {c['text']} |")
        ratio = best / by["default"]["tok_s"]
        ok &= ratio <= TOLERANCE
        within = "within" if ratio <= TOLERANCE else "NOT within"
        verdicts.append(f"{condition}: best / default = {ratio:.2f}x ({within} "
                        f"{TOLERANCE}x)")
    date = started.strftime("%Y-%m-%d")
    text = "\n".join([
        f"# Threads for the demo main job on cpu ({date})",
        "",
        f"- command: python bench/threads.py --runs {args.runs} --max-seconds {args.max_seconds:g}",
        f"- job: `dgemma generate \"{PROMPT}\"` as the CLI runs it (demo model, compiled, one bucket, seed 0), "
        "each cell in its own process (compile or Inductor-cache load before timing), the cells of a condition timed "
        "in interleaved rounds of 2 requests, medians over the runs",
        "- busy: one spin-loop process started by the script (killed after the busy cells)",
        "- default: `dgemma_compile.cli.threads.recommended_threads(model)`, chosen in the worker after the busy process "
        "started; the CLI applies the same unless --threads or OMP_NUM_THREADS is given",
        f"- device: {machine()}",
        f"- versions: {versions()}",
        f"- load average 1/5/15 min at start {load_start}, at end {load_average()}",
        f"- started {started:%Y-%m-%d %H:%M} UTC, finished {finished:%H:%M} UTC",
        "- note: a shared machine; other processes (other sessions' builds and tests) may have been running during any "
        "cell, in both conditions: \"idle\" means no spin loop of ours, not an idle machine. The 'CPUs free' column is "
        "the worker's own /proc/stat sample at its start.",
        "",
        "| condition | threads | tok/s median | TTFB ms median | request ms median | best / this | runs | CPUs free "
        "| compile s | output |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        *[f"- {v}" for v in verdicts],
        "",
    ])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"threads_cpu_{date}.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a live canvas frame costs (issue 40 item 2): per-iteration time of a request without frames against the
same request with frames, side by side in one run on the demo model.

    python -m bench.frames [--rounds 12] [--compiled] [--out bench/results]

One request (the demo's "rev" task, 64 new tokens, a hot schedule (temperature x3) so blocks take several denoise
steps, seed 0) runs to the end through the one driver (`driver.Driver`) over a bucket of one row: the eager step by
default, the compiled generator's step with `--compiled` (compile time reported apart; the compile cache used).
Each round runs it twice, without and with frames (`RowRequest.frames`), alternating which goes first; the runs'
tokens must be equal. `--without-only` runs only the request without frames: run under another checkout
(`PYTHONPATH` at a commit before frames, whose driver has no frames) it gives the before figure of the step, whose
frame writes (`mixed_step.DenoiseState.accepted` / `entropy`) every request now pays. Per run, each iteration's `Driver.step` wall time is recorded (the step, the report
read, and for the framed run the frames read, `Iteration.frames_s`), split into denoise iterations (the row
stepped) and the others (prefill, commit). Reported: medians over all rounds of the denoise iterations' time
without and with frames, their difference and ratio, the frames read alone, and the unframed run's
host-side driver time outside the step (report read + frames bookkeeping). Warm-up (one round each) is excluded.

Writes bench/results/frames_cpu_<date>.md and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import dgemma_compile as dg
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.step.driver import Driver
from dgemma_compile.step.requests import RequestStats
from dgemma_compile.inputs.text import encode_prompt

from . import environment

PROMPT = "rev 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5="
SLOTS = 256


class _Req:
    """A `driver.RowRequest`."""

    def __init__(self, prompt, config, frames: bool):
        self.prompt, self.config, self.seed, self.images, self.grammar = prompt, config, 0, None, None
        self.sequence, self.stats, self.frames, self.canvas = [], RequestStats(), frames, None


def run_once(driver: Driver, prompt, cfg, frames: bool) -> tuple[list[int], list[float], list[float], list[float]]:
    """One request to its end: (its tokens, denoise iterations' seconds, other iterations' seconds, frames reads)."""
    req = _Req(prompt, cfg, frames)
    driver.admit(0, req)
    denoise, other, reads = [], [], []
    while not driver.idle():
        t0 = time.perf_counter()
        it = driver.step()
        dt = time.perf_counter() - t0
        (denoise if it.reports[0].stepped else other).append(dt)
        if frames and it.frames:
            reads.append(it.frames_s)
        for f in it.finished:
            _, done = driver.finalize(f)
            if done or f.report.done:
                driver.retire(f.row, device_done=f.report.done)
    return req.sequence, denoise, other, reads


PLAIN, FRAMED = "without frames", "with frames"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--compiled", action="store_true", help="the compiled generator's step instead of the eager one")
    p.add_argument("--without-only", action="store_true", help="only the request without frames (a baseline run "
                   "under another checkout)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    cfg = model.generation_config.replace(max_new_tokens=64).with_temperature(3.0).resolved(model.config)
    prompt = encode_prompt(tok, PROMPT, bos_token_id=model.config.bos_token_id)
    compile_s = 0.0
    if args.compiled:
        from dgemma_compile.compile import CompileOptions, build

        gen = build(model, CompileOptions(batch_buckets=(1,), max_seq_len=SLOTS))
        compile_s = gen.warmup(1, cfg)
        row_table, step = gen.row_table(cfg), f"compiled ({gen.step_source}, {compile_s:.1f} s apart)"
    else:
        row_table, step = RowTable(model, (1,), max_seq_len=SLOTS, max_denoising_steps=64), "eager"
    driver = Driver(row_table)
    names = [PLAIN] if args.without_only else [PLAIN, FRAMED]
    for name in names:  # warm-up, excluded
        run_once(driver, prompt, cfg, name == FRAMED)
    runs = {name: ([], [], []) for name in names}
    tokens = {}
    start = time.perf_counter()
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seq, den, oth, reads = run_once(driver, prompt, cfg, name == FRAMED)
            assert tokens.setdefault(name, seq) == seq, "a request's tokens changed between rounds"
            for acc, xs in zip(runs[name], (den, oth, reads)):
                acc.extend(xs)
    assert all(t == tokens[PLAIN] for t in tokens.values()), "frames changed the tokens"
    wall = time.perf_counter() - start
    med = lambda xs: statistics.median(xs) * 1e6 if xs else float("nan")  # noqa: E731  (us)
    plain = med(runs[PLAIN][0])
    framed, reads = (med(runs[FRAMED][0]), med(runs[FRAMED][2])) if FRAMED in runs else (plain, float("nan"))
    rows = [f"| {name} | {len(runs[name][0])} | {med(runs[name][0]):.0f} | {med(runs[name][1]):.0f} | "
            f"{med(runs[name][2]):.0f} |".replace("| nan |", "| - |") for name in names]
    lines = [
        f"# Live canvas frames: per-iteration cost (`python -m bench.frames{' --compiled' if args.compiled else ''}"
        f"{' --without-only' if args.without_only else ''} --rounds {args.rounds}`)",
        "",
        f"{environment.now()}, commit {environment.git_commit()}, {environment.device_name('cpu')}, "
        f"load average {environment.load_average()}, torch {torch.__version__}, 1 intra-op thread.",
        "",
        f"Demo model, one request in a bucket of one row (step: {step}): `{PROMPT}`, 64 new tokens, temperature x3, "
        f"seed 0; {len(tokens[PLAIN])} tokens, {len(runs[PLAIN][0]) // args.rounds} denoise iterations per run; "
        f"{args.rounds} rounds, each running every variant (order rotating), after one warm-up run each; "
        f"{wall:.1f} s timed. Tokens equal in every variant (asserted).",
        "",
        "| request | denoise iterations | median `Driver.step` per denoise iteration (us) | other iterations' "
        "median (us) | frames read, median (us) |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"With frames / without: {framed / plain:.3f} ({framed - plain:+.0f} us per denoise iteration; the frames "
        f"read alone {reads:.0f} us). A request without frames adds no host read: the driver only checks its "
        "`frames` flag." if not args.without_only else
        f"Without frames only (the baseline of another checkout: `{dg.__file__}`).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = ("compiled_" if args.compiled else "") + ("without_" if args.without_only else "")
    path = args.out / f"frames_{tag}cpu_{environment.today()}.md"
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

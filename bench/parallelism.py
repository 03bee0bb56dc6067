"""Accuracy under parallelism: tokens per forward against exact match on the demo's held-out prompts.

Usage: ``python -m bench.parallelism [--n 200] [--offset 0] [--points default|smoke] [--no-ar] [--out DIR]
[--no-write]``

Sweeps the generation knobs that trade denoise steps for quality -- `GenerationConfig.entropy_bound` (how much
entropy a step may accept), `confidence_threshold` (the mean entropy under which a block may stop),
`max_denoising_steps` (the step limit per block) and `stability_threshold` (how many previous steps the argmax canvas
must equal before a block may stop) -- one knob at a time from the checkpoint's default (its generation_config.json),
plus a few joint points that push several knobs at once, so the curve reaches high parallelism. Each point runs the
eager reference generator (`dg.generate`, every prompt of the split in one batched call: a request's tokens depend
only on its prompt, its seed and its config, never on its batch mates) with seed 0 for every request, so a rerun
gives the same numbers. Prompts: ``tasks.make_split("heldout", n, 0, offset=offset)`` (offset 0: the test set).

Per point: exact match (``tools/eval_demo_model.py``'s rule: decode to the first eos, ``tasks.check``), overall and
per task, and tokens per forward (TPF: generated non-pad tokens / decoder passes, summed over the prompts, as
`RequestStats.tokens_per_forward` counts them). The AR baseline (``bench/ar.py``: the encoder as a causal LM,
greedy, one token per forward: TPF 1 by construction) runs on the same prompts and is scored the same way.

The score of the curve is d3LLM's AUP (`aup`); the sweep's points form a cloud, and AUP is taken over its
Pareto frontier (`frontier`: the points no other point beats on both axes), the curve the best setting for each
level of parallelism draws. Writes ``{prefix}cpu_{date}.csv``, ``.md`` (the table, the AUP, the command, versions)
and ``.png`` (matplotlib: ``pip install -e '.[plot]'``; without it the plot is skipped with a note) under
``bench/results/``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch

import dgemma_compile as dg
from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.demo import tasks as T

from . import environment

RESULTS = Path(__file__).resolve().parent / "results"
KNOBS = ("entropy_bound", "confidence_threshold", "max_denoising_steps", "stability_threshold", "stop_early")

#: One knob at a time from the checkpoint default (the default's own value is skipped: it is the "default" point).
SWEEP: dict[str, tuple] = {
    "entropy_bound": (0.05, 0.1, 0.25, 1.0, 2.0, 4.0),
    "confidence_threshold": (0.001, 0.003, 0.03, 0.1, 0.3),
    "max_denoising_steps": (1, 2, 4, 8, 32),
    "stability_threshold": (0, 2, 3),
}
#: Joint points: several knobs pushed together, stricter and looser than the default (one knob alone saturates
#: where another binds: a block needs stability_threshold + 1 steps before it may stop), and the fixed-steps run
#: (`stop_early=False`, the vLLM-style run: every block takes max_denoising_steps), the low end of the curve.
JOINT: tuple[dict, ...] = (
    dict(entropy_bound=0.05, confidence_threshold=0.001, stability_threshold=3),
    dict(entropy_bound=0.1, confidence_threshold=0.003, stability_threshold=2),
    dict(entropy_bound=4.0, confidence_threshold=0.3, stability_threshold=0),
    *(dict(stop_early=False, max_denoising_steps=s) for s in (1, 2, 4, 8, 16)),
)
SMOKE: dict[str, tuple] = {"stability_threshold": (0,), "max_denoising_steps": (2,)}

CSV_FIELDS = ["label", "family", *KNOBS, "exact_match", *(f"exact_{t}" for t in T.TASKS), "prefix_match",
              "tokens_per_forward", "tokens", "forwards", "steps_per_block", "prompts", "frontier", "seconds"]


@dataclasses.dataclass(frozen=True)
class Point:
    """One setting of the sweep: `family` is "default", a knob's name, "joint" or "ar"; `config` its generation
    config (None for the AR baseline)."""

    label: str
    family: str
    config: dg.GenerationConfig | None


@dataclasses.dataclass
class Result:
    """What one point measured. exact_match and per_task in percent; tokens_per_forward = tokens / forwards."""

    point: Point
    exact_match: float
    per_task: dict[str, float]
    tokens: int
    forwards: int
    blocks: int
    prompts: int
    seconds: float
    prefix_match: float = 0.0
    """Percent of completions that start with the answer (what follows ignored): not a score of the curve, a
    diagnostic of the AR baseline, which reads answers but was never trained to stop."""
    frontier: bool = False

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.forwards, 1)


# ---------------------------------------------------------------------------------------------------------------- AUP

def aup(points: Iterable[tuple[float, float]], *, alpha: float = 3.0, y_max: float | None = None) -> float:
    """d3LLM's AUP ("accuracy under parallelism") of a curve of (tokens per forward, accuracy in percent) points.

    Source: Qian, Su, Hu, Zhang, Zhao, Zhang, "AUP: when Accuracy Meets Parallelism in Diffusion Language Models"
    (hao-ai-lab blog, https://hao-ai-lab.github.io/blogs/text-diffusion/, 2025-11-21; the d3LLM repository's
    AUP_leaderboard, https://github.com/hao-ai-lab/d3LLM). With the points sorted so that rho_1 < ... < rho_m,

        AUP = rho_1 * y_1 + 1/2 * sum_{i=2..m} (rho_i - rho_{i-1}) * (y_i * W(y_i) + y_{i-1} * W(y_{i-1})),
        W(y) = min(exp(-alpha * (1 - y / y_max)), 1),  alpha = 3,

    where only points with y_i >= y_min = y_1 - 5 are included (y_1: the accuracy at the lowest parallelism) and
    y_max is "the highest accuracy achieved on that task" (default: the highest y among `points`; pass the best of
    every method compared, e.g. the AR baseline's, to score several curves on one scale). Units: rho in tokens per
    forward, y in percent [0, 100], so AUP is in percent x tokens per forward; a single point scores rho * y (an AR
    model at 1 token per forward scores its accuracy).

    Raises ValueError for no points, a rho <= 0, a y outside [0, 100], two points with the same rho (the definition
    needs a strictly increasing rho: pass a curve, e.g. `frontier`'s), or y_max <= 0.
    """
    pts = sorted((float(r), float(y)) for r, y in points)
    if not pts:
        raise ValueError("aup: no points")
    for r, y in pts:
        if not (r > 0 and math.isfinite(r)) or not 0 <= y <= 100:
            raise ValueError(f"aup: need rho > 0 and y in [0, 100], got ({r}, {y})")
    if any(a[0] == b[0] for a, b in zip(pts, pts[1:])):
        raise ValueError("aup: two points share a tokens-per-forward value; pass a curve (see frontier)")
    y_min = pts[0][1] - 5
    pts = [(r, y) for r, y in pts if y >= y_min]
    top = max(y for _, y in pts) if y_max is None else float(y_max)
    if top <= 0:
        raise ValueError(f"aup: y_max must be > 0, got {top}")

    def weighted(y: float) -> float:
        return y * min(math.exp(-alpha * (1 - y / top)), 1.0)

    total = pts[0][0] * pts[0][1]
    for (r0, y0), (r, y) in zip(pts, pts[1:]):
        total += 0.5 * (r - r0) * (weighted(y) + weighted(y0))
    return total


def frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the Pareto frontier of (tokens per forward, accuracy) points, by increasing tokens per forward: the
    points that no other point matches or beats on both axes (of equal points, the first). Accuracy falls along it."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1], i))
    keep, best = [], -math.inf
    for i in order:  # from the most parallel down: keep a point only if it is more accurate than all beyond it
        if points[i][1] > best:
            keep.append(i)
            best = points[i][1]
    return keep[::-1]


# --------------------------------------------------------------------------------------------------------- the plan

def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def plan(default: dg.GenerationConfig, sweep: dict[str, tuple] = SWEEP, joint: Sequence[dict] = JOINT) -> list[Point]:
    """The sweep's points: the default first, then each knob's values (the default's own value skipped), then the
    joint points; a config met twice is run once. Raises ConfigError for an invalid knob value."""
    points, seen = [Point("default", "default", default)], {default}
    for knob, values in sweep.items():
        for v in values:
            cfg = default.replace(**{knob: v})
            if cfg not in seen:
                seen.add(cfg)
                points.append(Point(f"{knob}={_fmt(v)}", knob, cfg))
    for changes in joint:
        cfg = default.replace(**changes)
        if cfg not in seen:
            seen.add(cfg)
            points.append(Point(" ".join(f"{k}={_fmt(v)}" for k, v in changes.items()), "joint", cfg))
    return points


# ------------------------------------------------------------------------------------------------------ measurement

def completion_text(tokenizer, new_ids: list[int]) -> str:
    """Generated ids decoded up to the first eos (tools/eval_demo_model.py's `completion_text`)."""
    eos = tokenizer.eos_token_id
    if eos in new_ids:
        new_ids = new_ids[: new_ids.index(eos)]
    return tokenizer.decode(new_ids, skip_special_tokens=True)


def _score(point: Point, tokenizer, examples, sequences, tokens: int, forwards: int, blocks: int,
           seconds: float) -> Result:
    hits, prefix = {t: [0, 0] for t in T.TASKS}, 0
    for (task, prompt, answer), seq in zip(examples, sequences):
        text = completion_text(tokenizer, seq)
        hits[task][0] += T.check(prompt, text)
        hits[task][1] += 1
        prefix += text.strip().startswith(answer.strip())
    n = len(examples)
    return Result(point, 100 * sum(h for h, _ in hits.values()) / max(n, 1),
                  {t: 100 * h / c for t, (h, c) in hits.items() if c}, tokens, forwards, blocks, n, seconds,
                  prefix_match=100 * prefix / max(n, 1))


def run_point(model, tokenizer, examples, point: Point, prompts: list[list[int]], max_seq_len: int) -> Result:
    """One diffusion point: `dg.generate` (eager) over every prompt at once, seed 0 for each, a KV cache of
    `max_seq_len` slots per row (attention reads every slot: the held-out prompts need about 80, the library's
    default of 1024 would make a step several times slower for the same tokens up to float reduction order)."""
    start = time.perf_counter()
    out = dg.generate(model, prompts, point.config, seed=0, max_seq_len=max_seq_len)
    seconds = time.perf_counter() - start
    return _score(point, tokenizer, examples, out.sequences, sum(s.num_tokens for s in out.stats),
                  sum(s.decoder_passes for s in out.stats), sum(s.blocks for s in out.stats), seconds)


def run_ar(model, tokenizer, examples, prompts: list[list[int]], max_new_tokens: int, max_seq_len: int,
           compiled: bool = False) -> Result:
    """The AR baseline of bench/ar.py (greedy) over every prompt at once: one token per forward, its forwards counted
    as generated tokens (its prefill, like ours, is not a decoder pass). Eager by default: only its tokens count
    here (compiled, the same two functions give the same argmax up to float reduction order; tests/bench/test_bench_ar.py),
    and the eager run spares the sweep two compiles."""
    from .ar import ARBaseline

    start = time.perf_counter()
    ar = ARBaseline(model, batch=len(prompts), max_seq_len=max_seq_len, compiled=compiled)
    eos = tuple(model.config.eos_token_ids)
    seqs = ar.generate(prompts, max_new_tokens, eos_ids=eos)
    pad = model.config.pad_token_id
    tokens = sum(1 for s in seqs for t in s if t != pad)
    return _score(Point("AR (bench/ar.py)", "ar", None), tokenizer, examples, seqs, tokens, tokens, 0,
                  time.perf_counter() - start)


def sweep(points: Sequence[Point], *, n: int, offset: int = 0, ar: bool = True, model_dir: Path = DEMO_MODEL,
          max_seq_len: int = 128, log=print) -> list[Result]:
    """Run every point (and the AR baseline) on held-out prompts [offset, offset + n); marks the frontier."""
    model = dg.load(str(model_dir))
    tokenizer = dg.load_tokenizer(str(model_dir))
    examples = T.make_split("heldout", n, 0, offset=offset)
    prompts = [tokenizer(p)["input_ids"] for _, p, _ in examples]
    results = []
    for i, point in enumerate(points):
        r = run_point(model, tokenizer, examples, point, prompts, max_seq_len)
        log(f"[{i + 1}/{len(points)}] {point.label}: exact {r.exact_match:.1f}% tpf {r.tokens_per_forward:.2f} "
            f"({r.seconds:.1f}s)")
        results.append(r)
    for i in frontier([(r.tokens_per_forward, r.exact_match) for r in results]):
        results[i].frontier = True
    if ar:
        budget = points[0].config.max_new_tokens
        r = run_ar(model, tokenizer, examples, prompts, budget, max_seq_len=max_seq_len)
        log(f"[AR] exact {r.exact_match:.1f}% tpf {r.tokens_per_forward:.2f} ({r.seconds:.1f}s, eager)")
        results.append(r)
    return results


# ---------------------------------------------------------------------------------------------------------- outputs

def scores(results: Sequence[Result], alpha: float = 3.0) -> dict[str, float]:
    """AUP of the diffusion frontier (y_max: the best accuracy of any point, AR included), the AR point's own AUP
    (rho = 1: its accuracy), and per task the AUP of that task's frontier."""
    diff = [r for r in results if r.point.family != "ar"]
    ar = [r for r in results if r.point.family == "ar"]
    top = max(r.exact_match for r in results)
    curve = [(diff[i].tokens_per_forward, diff[i].exact_match)
             for i in frontier([(r.tokens_per_forward, r.exact_match) for r in diff])]
    out = {"aup": aup(curve, alpha=alpha, y_max=top)}
    if ar:
        out["aup_ar"] = aup([(ar[0].tokens_per_forward, ar[0].exact_match)], alpha=alpha, y_max=top)
    for t in T.TASKS:  # per task: the overall tokens per forward (the sweep does not split forwards per task)
        pts = [(r.tokens_per_forward, r.per_task[t]) for r in diff if t in r.per_task]
        if pts:
            tmax = max([y for _, y in pts] + [r.per_task.get(t, 0) for r in ar])
            if tmax > 0:
                out[f"aup_{t}"] = aup([pts[i] for i in frontier(pts)], alpha=alpha, y_max=tmax)
    return out


def row(r: Result) -> dict:
    cfg = r.point.config
    d = {"label": r.point.label, "family": r.point.family,
         **{k: (getattr(cfg, k) if cfg is not None else "") for k in KNOBS},
         "exact_match": f"{r.exact_match:.2f}", "prefix_match": f"{r.prefix_match:.2f}",
         "tokens_per_forward": f"{r.tokens_per_forward:.4f}",
         "tokens": r.tokens, "forwards": r.forwards,
         "steps_per_block": f"{r.forwards / r.blocks:.3f}" if r.blocks else "",
         "prompts": r.prompts, "frontier": int(r.frontier), "seconds": f"{r.seconds:.2f}"}
    d.update({f"exact_{t}": f"{r.per_task[t]:.2f}" if t in r.per_task else "" for t in T.TASKS})
    return d


def write_csv(results: Sequence[Result], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerow(row(r))
    return path


def write_plot(results: Sequence[Result], path: Path, title: str) -> Path | None:
    """Tokens per forward (x) against exact match (y): every point by family, the frontier as a line, the default
    and the AR baseline marked. Returns None (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    markers = {"entropy_bound": "o", "confidence_threshold": "s", "max_denoising_steps": "^",
               "stability_threshold": "v", "joint": "D"}
    for k, (fam, m) in enumerate(markers.items()):  # hollow, shrinking: points that coincide stay visible
        pts = [r for r in results if r.point.family == fam]
        if pts:
            ax.scatter([r.tokens_per_forward for r in pts], [r.exact_match for r in pts], marker=m, s=150 - 25 * k,
                       facecolors="none", edgecolors=f"C{k}", linewidths=1.2, label=f"{fam} ({len(pts)})")
    front = sorted((r for r in results if r.frontier), key=lambda r: r.tokens_per_forward)
    ax.plot([r.tokens_per_forward for r in front], [r.exact_match for r in front], "k-", lw=1, alpha=0.6)
    ax.scatter([r.tokens_per_forward for r in front], [r.exact_match for r in front], marker="o", s=12, c="k",
               label="Pareto frontier (the AUP curve)")
    for r in results:
        if r.point.family == "default":
            ax.scatter([r.tokens_per_forward], [r.exact_match], marker="*", s=260, c="gold", edgecolors="k",
                       zorder=5, label=f"checkpoint default ({r.tokens_per_forward:.2f}, {r.exact_match:.0f}%)")
        if r.point.family == "ar":
            ax.scatter([r.tokens_per_forward], [r.exact_match], marker="X", s=140, c="red", edgecolors="k",
                       zorder=5, label=f"AR baseline (1 tok/fwd, {r.exact_match:.0f}%)")
    ax.set_xlabel("tokens per forward (generated tokens / decoder passes)")
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(-3, 103)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown(results: Sequence[Result], sc: dict[str, float], *, command: str, n: int, offset: int, seconds: float,
             plot: Path | None, max_seq_len: int = 128) -> str:
    v = environment.versions()
    lines = [f"# Accuracy under parallelism: demo model, held-out prompts {offset}-{offset + n - 1} (CPU)", "",
             f"- command: `{command}`", f"- date: {environment.now()}; runtime {seconds:.0f} s (eager `dg.generate`, "
             f"all prompts of a point in one batch, seed 0, "
             f"KV cache {max_seq_len} slots per row; torch threads {torch.get_num_threads()})",
             f"- versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
             f"dgemma_compile {v['dgemma_compile']}; device {environment.device_name('cpu')}",
             f"- load average {environment.load_average()}", "",
             f"**AUP (d3LLM, alpha 3) of the frontier: {sc['aup']:.1f}**"
             + (f"; the AR baseline's own AUP (one point at 1 token per forward): {sc['aup_ar']:.1f}" if "aup_ar" in sc
                else "") + ". Per task (frontier of that task's exact match against overall tokens per forward): "
             + ", ".join(f"{t} {sc['aup_' + t]:.1f}" for t in T.TASKS if "aup_" + t in sc) + ".", "",
             "AUP = rho_1 y_1 + 1/2 sum_i (rho_i - rho_{i-1})(y_i W(y_i) + y_{i-1} W(y_{i-1})), "
             "W(y) = min(exp(-3 (1 - y / y_max)), 1), over the points with y >= y_1 - 5 (Qian et al., "
             "https://hao-ai-lab.github.io/blogs/text-diffusion/); here over the Pareto frontier of the sweep, "
             "y_max the best exact match of any point (AR included).", ""]
    if plot is not None:
        lines += [f"![tokens per forward against exact match]({plot.name})", ""]
    else:
        lines += ["(no plot: matplotlib is not installed; `pip install -e '.[plot]'`)", ""]
    head = ["point", *KNOBS, "exact %", *(f"{t} %" for t in T.TASKS), "prefix %", "tok/fwd", "steps/block", "frontier"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        d = row(r)
        lines.append("| " + " | ".join([("**default**" if r.point.family == "default" else d["label"]),
                                         *(str(d[k]) for k in KNOBS), d["exact_match"],
                                         *(d[f"exact_{t}"] for t in T.TASKS), d["prefix_match"],
                                         f"{r.tokens_per_forward:.2f}",
                                         d["steps_per_block"] or "-", "yes" if r.frontier else ""]) + " |")
    lines += ["", "tok/fwd: generated non-pad tokens (eos included) / decoder passes, summed over the prompts "
              "(`RequestStats.tokens_per_forward`); the AR baseline generates one token per forward by construction "
              "(bench/ar.py run eagerly: `ARBaseline(compiled=False)`, greedy, the same prompts, token budget and "
              "eos)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="held-out prompts (default 200)")
    ap.add_argument("--offset", type=int, default=0, help="first held-out prompt (0: the test set; 500: validation)")
    ap.add_argument("--points", choices=("default", "smoke"), default="default",
                    help="default: the full sweep (SWEEP + JOINT); smoke: the default and two more points")
    ap.add_argument("--no-ar", action="store_true", help="skip the AR baseline (~10 s at n=200)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=128,
                    help="KV cache slots per row (default 128: the held-out prompts and 32 new tokens fit)")
    ap.add_argument("--model-dir", type=Path, default=DEMO_MODEL)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--prefix", default="parallelism_")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    default = dg.load(str(args.model_dir)).generation_config
    pts = plan(default, *((SWEEP, JOINT) if args.points == "default" else (SMOKE, ())))
    start = time.perf_counter()
    results = sweep(pts, n=args.n, offset=args.offset, ar=not args.no_ar, model_dir=args.model_dir,
                    max_seq_len=args.max_seq_len)
    seconds = time.perf_counter() - start
    sc = scores(results)
    print(f"AUP {sc['aup']:.2f}" + (f" (AR baseline {sc['aup_ar']:.2f})" if "aup_ar" in sc else ""))
    paths: list[Path] = []
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"{args.prefix}cpu_{environment.today()}"
        paths.append(write_csv(results, stem.with_suffix(".csv")))
        title = f"demo model, held-out {args.offset}-{args.offset + args.n - 1}: AUP {sc['aup']:.1f}"
        plot = write_plot(results, stem.with_suffix(".png"), title)
        given = argv if argv is not None else sys.argv[1:]
        command = "OMP_NUM_THREADS=1 python -m bench.parallelism " + " ".join(given)
        md = stem.with_suffix(".md")
        md.write_text(markdown(results, sc, command=command.strip(), n=args.n, offset=args.offset, seconds=seconds,
                               plot=plot, max_seq_len=args.max_seq_len))
        paths += [md] + ([plot] if plot else [])
        print("\n".join(str(p) for p in paths))
    return {"results": results, "scores": sc, "paths": paths, "seconds": seconds}


if __name__ == "__main__":
    main()

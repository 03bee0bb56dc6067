"""`python -m bench.before_after`: this tree against earlier commits of dgemma_compile, side by side in one run.

    git worktree add --detach /work/wt-6fb0154 6fb0154
    python -m bench.before_after --after . --before 6fb0154=/work/wt-6fb0154 --before 7592d24=/work/wt-7592d24

Each tree's code runs in its own fresh `python -c` worker per measurement and round, so two layouts of the package
(before and after issue 41 moved the modules) never share a process. A worker imports its tree from a copy of the
tree's import packages (`dgemma_compile/`, and whatever its pyproject.toml maps with setuptools' `package-dir`) taken
at the start, with `PYTHONPATH` = that copy and a neutral working directory; it reports where every
`dgemma_compile*` / `dgemma_runtime*` module came from, and the run stops if one came from elsewhere (the venv's
editable install would otherwise serve this tree to every side). Workers run one thread (`OMP_NUM_THREADS=1`,
`torch.set_num_threads(1)`). Every tree compiles or loads its steps as it would for a user, through the user's caches
(the trees share them: our compile cache keys each step by the sources of the tree that made it, and Inductor's own
caches key by graph); a tree whose steps are not cached compiles them in round 1, whose warm-up seconds are reported
apart from every timing.

Rounds interleave the trees: round r runs each measurement for every tree before the next measurement, the trees'
order rotated by one each round, so a slow spell of the shared machine lands on every tree and no tree always runs
first. Ratios are after / before per baseline: the ratio of the medians over rounds, and the median of the per-round
ratios (paired: cancels a slow spell that hit one round).

Measurements (issue 39 item 5), the library path (`build(...).generate`), written against API every tree has:
- `demo_b1`: the demo model, `build(model, CompileOptions(max_seq_len=256))`, warmed at 1; the held-out prompts
  `tasks.make_split("heldout", N, seed=0)`, prompt i with seed i, one `generate` call each, adaptive (the checkpoint's
  generation config) and fixed (`stop_early=False, max_denoising_steps=8`); tok/s = generated tokens / summed wall
  time of the calls; p50 of the calls.
- `demo_b8`: the first 8 of those prompts in one `generate` call (seeds 0..7), untimed once, then `--calls` times;
  tok/s per call, median.
- `scaled_b1`: bench/models.py's `scaled` checkpoint (random weights, bf16; written once by the after tree's
  builder, read by every tree), one prompt of 256 random ids, 256 new tokens, fixed 8 steps, batch 1,
  `CompileOptions(max_seq_len=512)`.
The generated token ids are compared between trees (they match where the trees' `sampler.SCHEME` does) and across a
tree's rounds (they must).

Writes bench/results/before_after_cpu_<date>.md (`--output` to choose).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from bench.environment import device_name, load_average

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# ----- worker snippets (`python -c SNIPPET JSON_ARGS`, cwd a neutral temp dir) --------------------------------------
COMMON = r'''
import importlib, json, os, resource, statistics, sys, time
import torch
torch.set_num_threads(1)
A = json.loads(sys.argv[1])
R = {}
import dgemma_compile as dg

def first_module(*names):
    """The first of `names` (one module in the trees' two layouts, before and after issue 41) that exists in this
    tree's copy, looked up on disk: importing a missing name would reach the venv's editable install instead."""
    base = os.path.dirname(dg.__file__)
    for n in names:
        path = os.path.join(base, *n.split(".")[1:])
        if os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py")):
            return importlib.import_module(n)
    raise ImportError(f"none of {names} in {base}")

R.update(file=dg.__file__, torch=torch.__version__, threads=torch.get_num_threads(),
         scheme=first_module("dgemma_compile.step.sampler", "dgemma_compile.sampler").SCHEME)

def done():
    R["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    roots = json.loads(os.environ["BEFORE_AFTER_ROOTS"])
    R["foreign"] = sorted(f"{n} ({m.__file__})" for n, m in list(sys.modules.items())
                          if n.split(".")[0] in ("dgemma_compile", "dgemma_runtime") and getattr(m, "__file__", None)
                          and not any(m.__file__.startswith(r) for r in roots))
    print("RESULT " + json.dumps(R), flush=True)

def demo():
    from dgemma_compile.demo import DEMO_MODEL, tasks
    encode_prompt = first_module("dgemma_compile.inputs.text", "dgemma_compile.text").encode_prompt
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    prompts = [p for _, p, _ in tasks.make_split("heldout", A["prompts"], seed=0)]
    ids = [encode_prompt(tok, p, bos_token_id=model.config.bos_token_id) for p in prompts]
    cfg = model.generation_config
    return model, tok, tasks, prompts, ids, cfg, cfg.replace(stop_early=False, max_denoising_steps=A["fixed_steps"])
'''

DEMO_B1 = COMMON + r'''
model, tok, tasks, prompts, ids, cfg, fixed = demo()
gen = dg.build(model, dg.CompileOptions(max_seq_len=256))
R["warmup_s"] = gen.warmup(1, cfg)
for c in (cfg, fixed):  # untimed
    gen.generate([ids[0]], c, seed=0)
for name, c in (("adaptive", cfg), ("fixed", fixed)):
    walls, toks, seqs, right = [], 0, [], 0
    for i, x in enumerate(ids):
        t0 = time.perf_counter()
        out = gen.generate([x], c, seed=i)
        walls.append(time.perf_counter() - t0)
        toks += out.stats[0].num_tokens
        seqs.append(list(out.sequences[0]))
        right += tasks.check(prompts[i], tok.decode(out.sequences[0], skip_special_tokens=True))
    R[name] = dict(tok_s=toks / sum(walls), p50_ms=statistics.median(walls) * 1e3, exact=right / len(ids), seqs=seqs)
done()
'''

DEMO_B8 = COMMON + r'''
model, tok, tasks, prompts, ids, cfg, fixed = demo()
gen = dg.build(model, dg.CompileOptions(max_seq_len=256))
R["warmup_s"] = gen.warmup(8, cfg)
batch, seeds = ids[:8], list(range(8))
for name, c in (("adaptive", cfg), ("fixed", fixed)):
    gen.generate(batch, c, seed=seeds)  # untimed
    rates = []
    for _ in range(A["calls"]):
        t0 = time.perf_counter()
        out = gen.generate(batch, c, seed=seeds)
        rates.append(sum(st.num_tokens for st in out.stats) / (time.perf_counter() - t0))
    R[name] = dict(tok_s=statistics.median(rates), seqs=[list(s) for s in out.sequences])
done()
'''

SCALED_B1 = COMMON + r'''
model = dg.load(A["checkpoint"])
cfg = model.generation_config.replace(stop_early=False, max_denoising_steps=A["fixed_steps"],
                                      max_new_tokens=A["new_tokens"])
g = torch.Generator().manual_seed(0)
prompt = torch.randint(3, model.config.vocab_size, (A["prompt_len"],), generator=g).tolist()
gen = dg.build(model, dg.CompileOptions(max_seq_len=A["max_seq_len"]))
R["warmup_s"] = gen.warmup(1, cfg)
gen.generate([prompt], cfg, seed=0)  # untimed
walls, toks, seqs = [], 0, []
for i in range(A["requests"]):
    t0 = time.perf_counter()
    out = gen.generate([prompt], cfg, seed=i)
    walls.append(time.perf_counter() - t0)
    toks += out.stats[0].num_tokens
    seqs.append(list(out.sequences[0]))
R["fixed"] = dict(tok_s=toks / sum(walls), request_s=statistics.median(walls), seqs=seqs)
done()
'''

SNIPPETS = {"demo_b1": DEMO_B1, "demo_b8": DEMO_B8, "scaled_b1": SCALED_B1}

METRICS = [  # (measurement, path in the worker's result, label, unit, better)
    ("demo_b1", "adaptive.tok_s", "demo b1 adaptive", "tok/s", "higher"),
    ("demo_b1", "adaptive.p50_ms", "demo b1 adaptive, request p50", "ms", "lower"),
    ("demo_b1", "fixed.tok_s", "demo b1 fixed 8 steps", "tok/s", "higher"),
    ("demo_b1", "fixed.p50_ms", "demo b1 fixed 8 steps, request p50", "ms", "lower"),
    ("demo_b8", "adaptive.tok_s", "demo b8 adaptive (one call of 8)", "tok/s", "higher"),
    ("demo_b8", "fixed.tok_s", "demo b8 fixed 8 steps (one call of 8)", "tok/s", "higher"),
    ("scaled_b1", "fixed.tok_s", "scaled b1 fixed 8 steps", "tok/s", "higher"),
    ("scaled_b1", "fixed.request_s", "scaled b1 fixed 8 steps, request", "s", "lower"),
    ("demo_b1", "maxrss_mb", "peak RSS: demo b1 worker", "MB", "lower"),
    ("scaled_b1", "maxrss_mb", "peak RSS: scaled b1 worker", "MB", "lower"),
    ("demo_b1", "warmup_s", "warm-up: demo gen.warmup(1) (round 1 compiles where the cache has no entry)", "s", "lower"),
    ("scaled_b1", "warmup_s", "warm-up: scaled gen.warmup(1) (round 1 compiles where the cache has no entry)", "s",
     "lower"),
]
TOKENS = [("demo_b1", "adaptive"), ("demo_b1", "fixed"), ("demo_b8", "adaptive"), ("demo_b8", "fixed"),
          ("scaled_b1", "fixed")]


# ----- trees ---------------------------------------------------------------------------------------------------------
def packages(tree: Path) -> dict[str, Path]:
    """A tree's import packages: dgemma_compile/, plus the top-level names its pyproject.toml maps with setuptools'
    `package-dir` (after issue 23: `dgemma_runtime` = runtime/, which `PYTHONPATH=<tree>` alone would not find)."""
    found = {"dgemma_compile": tree / "dgemma_compile"}
    try:
        dirs = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {}) \
            .get("package-dir", {})
    except (OSError, tomllib.TOMLDecodeError):
        dirs = {}
    for name, rel in dirs.items():
        if name and "." not in name and (tree / rel / "__init__.py").exists():
            found[name] = tree / rel
    return found


def _git(tree: Path, *args: str) -> str:
    p = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30)
    return p.stdout.strip()


def snapshot(label: str, tree: Path, scratch: Path) -> dict:
    """Copy `tree`'s import packages to scratch/label/ (edits made to the tree during the run reach no worker);
    returns the tree's record: path, commit, subject, uncommitted changes, the copy's root."""
    root = scratch / label
    pkgs = packages(tree)
    for name, src in pkgs.items():
        shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    dirty = _git(tree, "status", "--porcelain", "--untracked-files=no", "--",
                 *(str(p.relative_to(tree)) for p in pkgs.values()))
    return dict(label=label, path=str(tree), root=str(root), packages=sorted(pkgs),
                commit=_git(tree, "rev-parse", "--short", "HEAD") or "unknown",
                subject=_git(tree, "log", "-1", "--format=%s"), dirty=bool(dirty))


def run_worker(name: str, tree: dict, args: dict, timeout: float, workdir: Path) -> dict:
    """One measurement of one tree in a fresh interpreter; its RESULT line, or {"error": ...}."""
    env = dict(os.environ, PYTHONPATH=tree["root"], OMP_NUM_THREADS="1", BEFORE_AFTER_ROOTS=json.dumps([tree["root"]]))
    env.pop("PYTHONSTARTUP", None)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", SNIPPETS[name], json.dumps(args)], cwd=workdir, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            res = {"error": f"timed out after {timeout:.0f} s"}
        else:
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode == 0 and lines:
                res = json.loads(lines[-1][len("RESULT "):])
            else:
                err.seek(0)
                res = {"error": f"exit {proc.returncode}: " + " | ".join(err.read().strip().splitlines()[-6:])[-600:]}
    res["worker_s"] = time.perf_counter() - start
    if "file" in res and not res["file"].startswith(tree["root"]):
        raise SystemExit(f"{name} {tree['label']}: imported {res['file']}, not the copy under {tree['root']}")
    if res.get("foreign"):
        raise SystemExit(f"{name} {tree['label']}: modules from outside its copy: {', '.join(res['foreign'][:4])}")
    print(f"  {name:10s} {tree['label']:10s} {res['worker_s']:6.1f} s  {res.get('error', 'ok')[:200]}",
          file=sys.stderr, flush=True)
    return res


def scaled_checkpoint(after: Path) -> str:
    """The `scaled` checkpoint written by the after tree's bench/models.py (once; cached by that module)."""
    env = dict(os.environ, PYTHONPATH=str(after), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", "from bench.models import scaled_checkpoint; print(scaled_checkpoint())"],
                       cwd=after, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"building the scaled checkpoint failed: {p.stderr.strip()[-1000:]}")
    return p.stdout.strip().splitlines()[-1]


def rotation(labels: list[str], r: int) -> list[str]:
    """The trees' order in round r (0-based): rotated by one each round."""
    k = r % len(labels)
    return labels[k:] + labels[:k]


# ----- report --------------------------------------------------------------------------------------------------------
def value(res: dict, path: str):
    x = res
    for k in path.split("."):
        if not isinstance(x, dict) or x.get(k) is None:
            return None
        x = x[k]
    return x


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def ratios(after: list, before: list) -> tuple[float | None, float | None]:
    """(median(after) / median(before), median over rounds of after / before of the same round), both over the
    rounds where both trees have a value (a failed worker's round leaves both sides)."""
    pairs = [(a, b) for a, b in zip(after, before) if a is not None and b]
    if not pairs:
        return None, None
    ma, mb = _median([a for a, _ in pairs]), _median([b for _, b in pairs])
    return ma / mb, _median([a / b for a, b in pairs])


def verdict(better: str, ratio: float | None, paired: float | None) -> str:
    """"yes" when both ratios say after is no worse than before (>= 1.0x for higher-is-better, <= 1.0x for
    lower-is-better), "no" when both say worse, "mixed" otherwise."""
    if ratio is None or paired is None:
        return "n/a"
    ok = [(x >= 1.0) if better == "higher" else (x <= 1.0) for x in (ratio, paired)]
    return "yes" if all(ok) else "no" if not any(ok) else "mixed"


def token_line(results: dict, name: str, key: str, a: str, b: str) -> str | None:
    ra = [r for r in results[name][a] if value(r, key + ".seqs") is not None]
    rb = [r for r in results[name][b] if value(r, key + ".seqs") is not None]
    if not ra or not rb:
        return None
    sa, sb = ra[0][key]["seqs"], rb[0][key]["seqs"]
    differ = sum(x != y for x, y in zip(sa, sb)) + abs(len(sa) - len(sb))
    line = f"{'identical' if differ == 0 else 'differ'} ({differ} of {max(len(sa), len(sb))} requests differ)"
    unstable = [lab for lab, rs in ((a, ra), (b, rb)) if any(r[key]["seqs"] != rs[0][key]["seqs"] for r in rs)]
    return line + (f"; NOT stable across rounds in: {', '.join(unstable)}" if unstable else "")


def report(argv: list[str], trees: list[dict], results: dict, plan: dict, started: str, load_start: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    after, befores = trees[0]["label"], [t["label"] for t in trees[1:]]

    def first(label, key):
        return next((r[key] for rs in results.values() for r in rs[label] if r.get(key) is not None), "?")

    def ver(p):
        try:
            return importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    threads = ", ".join(f"{t['label']} {first(t['label'], 'threads')}" for t in trees)
    L = [f"# Before / after, side by side: {after} against {', '.join(befores)} (CPU, {now:%Y-%m-%d})", "",
         f"- command: `python -m bench.before_after {' '.join(argv)}`",
         f"- machine: {device_name('cpu')}, shared; load average 1/5/15 min at start {load_start}, at end "
         f"{load_average()}",
         f"- versions: python {platform.python_version()}, torch {ver('torch')}, transformers {ver('transformers')}",
         f"- workers: one fresh `python -c` per measurement, tree and round, one thread (threads seen: "
         f"{threads}); rounds interleaved, the "
         f"trees' order rotated each round; {plan['rounds']} round(s); started {started}, finished "
         f"{now:%Y-%m-%d %H:%M} UTC"]
    for t in trees:
        role = "after" if t["label"] == after else "before"
        L.append(f"- {role} `{t['label']}`: `{t['path']}` at `{t['commit']}`{' +uncommitted changes' if t['dirty'] else ''}"
                 f" ({t['subject']}); packages {', '.join(f'`{p}`' for p in t['packages'])} run from a copy taken at "
                 f"the start; sampler.SCHEME `{first(t['label'], 'scheme')}`")
    L += ["", f"Medians over rounds. `{after} / X` = median({after}) / median(X); paired = the median over rounds of "
          "the same round's ratio. For \"higher\" rows > 1 is better, for \"lower\" rows < 1. no worse: both ratios "
          "say so. Per-round values in the last columns.", ""]
    head = ["measurement", "unit", "better", *(t["label"] for t in trees)]
    for b in befores:
        head += [f"{after} / {b}", "paired", "no worse"]
    head += [f"{t['label']} per round" for t in trees]
    L += ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 3 or i >= len(head) - len(trees) else "---:"
                                                          for i in range(len(head))) + "|"]
    for name, path, label, unit, better in METRICS:
        if name not in results:
            continue
        vals = {t["label"]: [value(r, path) for r in results[name][t["label"]]] for t in trees}
        if all(_median(v) is None for v in vals.values()):
            continue
        row = [label, unit, better, *(_fmt(_median(vals[t["label"]])) for t in trees)]
        for b in befores:
            ratio, paired = ratios(vals[after], vals[b])
            row += [f"{ratio:.2f}x" if ratio else "n/a", f"{paired:.2f}x" if paired else "n/a",
                    verdict(better, ratio, paired) if not label.startswith(("peak", "warm-up")) else "-"]
        row += [", ".join(_fmt(v) for v in vals[t["label"]]) for t in trees]
        L.append("| " + " | ".join(row) + " |")
    L += ["", "## Tokens", ""]
    for name, key in TOKENS:
        for b in befores:
            line = token_line(results, name, key, after, b) if name in results else None
            if line is not None:
                L.append(f"- {name} {key}: {after} against {b}: {line}")
    for t in trees:
        ex = _median([value(r, "adaptive.exact") for r in results.get("demo_b1", {}).get(t["label"], [])])
        if ex is not None:
            L.append(f"- demo b1 adaptive exact match ({t['label']}): {100 * ex:.1f}%")
    L.append("- tokens match between trees whose sampler.SCHEME is the same; within a tree every round must agree.")
    L += ["", "## Settings", "",
          f"- demo b1: {plan['demo_b1']['prompts']} held-out prompts, fixed = {plan['demo_b1']['fixed_steps']} "
          f"denoise steps a block; demo b8: the first 8 prompts in one call, {plan['demo_b8']['calls']} timed calls",
          f"- scaled b1: `{plan['scaled_b1'].get('checkpoint', '-')}`, {plan['scaled_b1']['requests']} requests of "
          f"{plan['scaled_b1']['new_tokens']} new tokens after a {plan['scaled_b1']['prompt_len']}-token prompt"]
    errors = [f"- {name} {lab} round {k + 1}: {r['error']}" for name, rs in results.items() for lab, runs in rs.items()
              for k, r in enumerate(runs) if r.get("error")]
    if errors:
        L += ["", "## Errors", ""] + errors
    wall = [r.get("worker_s", 0) for rs in results.values() for runs in rs.values() for r in runs]
    L += ["", f"Worker time in all: {sum(wall) / 60:.1f} min over {len(wall)} workers.", ""]
    return "\n".join(L)


def _tree_arg(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"--before {text!r}: expected LABEL=PATH")
    return label, Path(path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.before_after", description=__doc__.split("\n\n")[0])
    p.add_argument("--after", type=Path, default=REPO, help="the tree measured (default: this one)")
    p.add_argument("--after-label", default="main", help="its label in the report (default main)")
    p.add_argument("--before", type=_tree_arg, action="append", required=True, metavar="LABEL=PATH",
                   help="a baseline tree; repeat for more")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--prompts", type=int, default=20, help="demo b1 prompts (default 20)")
    p.add_argument("--calls", type=int, default=10, help="demo b8 timed calls (default 10)")
    p.add_argument("--requests", type=int, default=5, help="scaled b1 timed requests (default 5)")
    p.add_argument("--only", default=",".join(SNIPPETS), help=f"comma list of measurements (default {','.join(SNIPPETS)})")
    p.add_argument("--timeout", type=float, default=900, help="seconds a worker may run (default 900)")
    p.add_argument("--output", type=Path, default=None, help="results file (default bench/results/...)")
    args = p.parse_args(argv)
    only = [m for m in args.only.split(",") if m]
    if unknown := [m for m in only if m not in SNIPPETS]:
        p.error(f"--only: unknown measurement(s) {unknown}; known: {', '.join(SNIPPETS)}")
    sources = [(args.after_label, args.after.resolve())] + [(lab, path.resolve()) for lab, path in args.before]
    if len({lab for lab, _ in sources}) != len(sources):
        p.error("every tree needs its own label")
    for lab, path in sources:
        if not (path / "dgemma_compile" / "__init__.py").exists():
            p.error(f"tree {lab} ({path}): no dgemma_compile/ package there")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_start = load_average()
    scratch = Path(tempfile.mkdtemp(prefix="dgemma_before_after_"))
    try:
        workdir = scratch / "cwd"  # neutral cwd: `python -c` puts it first on sys.path
        workdir.mkdir()
        trees = [snapshot(lab, path, scratch) for lab, path in sources]
        plan = {"rounds": args.rounds, "demo_b1": dict(prompts=args.prompts, fixed_steps=8),
                "demo_b8": dict(prompts=8, fixed_steps=8, calls=args.calls),
                "scaled_b1": dict(fixed_steps=8, prompt_len=256, new_tokens=256, max_seq_len=512,
                                  requests=args.requests)}
        if "scaled_b1" in only:
            plan["scaled_b1"]["checkpoint"] = scaled_checkpoint(sources[0][1])
        results = {m: {t["label"]: [] for t in trees} for m in only}
        by_label = {t["label"]: t for t in trees}
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
            for m in only:
                for lab in rotation(list(by_label), r):
                    results[m][lab].append(run_worker(m, by_label[lab], plan[m], args.timeout, workdir))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = report(argv, trees, results, plan, started, load_start)
    out = args.output or RESULTS / f"before_after_cpu_{datetime.date.today():%Y-%m-%d}.md"
    out.write_text(text)
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

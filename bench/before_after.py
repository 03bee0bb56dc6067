"""`python -m bench.before_after`: issue 23 item 7, before and after the redesign side by side in one run.

    python -m bench.before_after --before /work/wt-before --after /work/main            # full: ~30-40 min, 2 cores
    python -m bench.before_after --before /work/wt-before --after /work/main --quick    # ~4-5 min (warm Inductor cache)

Two source trees of dgemma_compile (each imported with `PYTHONPATH=<tree>` from a neutral working directory, so that
neither the venv's editable install nor the current directory decides which one runs; every worker reports the
`dgemma_compile.__file__` it imported and the run stops if it is not the tree's; every worker also checks that each
`dgemma_compile*` / `dgemma_runtime*` module it loaded came from the tree). A tree's packages are dgemma_compile/ and
those its pyproject.toml maps with package-dir (after the redesign the engine and server moved to the top-level
runtime/, imported as `dgemma_runtime`; before it they were `dgemma_compile.runtime`). By default each tree's packages
(uncommitted changes and the demo model included) are copied to a temp dir at the start and run from there, so that
edits made to a tree during the run do not reach later workers (`--no-snapshot`: links to the tree in place); the
report names each tree's commit (`git rev-parse --short HEAD`) and notes a tree that changed. Every measurement runs
in a fresh `python -c` subprocess with `OMP_NUM_THREADS=1` and `torch.set_num_threads(1)`, written against public API
that exists in both trees only (the engine's package by its name in each tree). Rounds interleave the trees: round r
runs measurement m for `before`, then for `after`, then the next measurement (ABAB...), so a slow spell of the shared
machine lands on both.

Measurements (per tree and round unless said):

- `demo_b1`: the demo model, `dg.build(model, CompileOptions(max_seq_len=256))` (default batch buckets), warmed up;
  the held-out prompts `tasks.make_split("heldout", N, seed=0)`, prompt i with seed i, one `gen.generate` each:
  adaptive (the checkpoint's generation config) and fixed-step (`stop_early=False, max_denoising_steps=8`);
  tok/s = generated tokens / summed wall time of the calls. The token ids are compared between trees.
- `demo_b8`: the first 8 of those prompts in one `gen.generate` call (seeds 0..7), repeated; tok/s per call, median.
- `scaled_b1`: bench/models.py's `scaled` checkpoint (random weights, bf16; written once to /tmp by the after tree's
  builder and read by both), one prompt of random ids, fixed step at batch 1; skipped with a note past 2 min.
- `engine`: `build_engine(model, max_batch=8, max_seq_len=256)` (defaults: compiled, warmed by the call),
  then per prompt: submit one `Request`, call `engine.step()` in this thread until `engine.idle()`, time submit ->
  final event; beside it (alternating) the offline `gen.generate` of the same request on a batch-1 build.
- `serve_default`: `python -m dgemma_compile.cli serve` with default flags (`--max-batch 8`) and `--compile always`
  (`--serve-compile`: both trees serve compiled steps; with auto a tree whose steps are not cached serves eagerly
  while a background compile runs, and the worker's shutdown kills it before it fills the cache), started by the worker;
  start -> first answered request; warm-up traffic at every concurrency down from max-batch (every batch size
  compiled); c=1 latency over sequential /v1/completions (httpx, max_tokens 16, seed = prompt index).
- `serve_16`: the same with `--max-batch 16 --max-seq-len 256` (the settings of serve_cpu_2026-12-01_mixed.md): c=1
  latency as above, then c=16 throughput (16 concurrent clients for `--duration` s, the checkpoint's config as
  bench/serve.py, tokens from usage.completion_tokens).
- peak RSS: `ru_maxrss` of every torch worker; of the server process (VmHWM) for the serve workers.
- `cold_generate` / `cold_serve` (once per tree, after the rounds; not with --quick): an empty Inductor cache
  (`TORCHINDUCTOR_CACHE_DIR` a fresh temp dir, FX-graph and AOTAutograd caches on there, Triton's there too):
  wall time of `dgemma generate "sort 3 1 2 9 5="` to exit, and of `dgemma serve` from start to its first answer.

Writes bench/results/before_after_cpu_<date>.md (`--quick`: ..._quick.md; `--output` to choose).
"""

from __future__ import annotations

import argparse
import atexit
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SIDES = ("before", "after")

# ----- worker snippets (run with `python -c SNIPPET JSON_ARGS`, cwd a neutral temp dir) ---------------------------
LIGHT = r'''
import json, os, resource, statistics, sys, time
A = json.loads(sys.argv[1])
R = {}
def done():
    R["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    roots = json.loads(os.environ["BEFORE_AFTER_ROOTS"])  # every module of ours must come from the tree's copy
    R["foreign"] = sorted(f"{n} ({m.__file__})" for n, m in list(sys.modules.items())
                          if n.split(".")[0] in ("dgemma_compile", "dgemma_runtime") and getattr(m, "__file__", None)
                          and not any(m.__file__.startswith(r) for r in roots))
    print("RESULT " + json.dumps(R), flush=True)
'''

TORCH = LIGHT + r'''
import torch
torch.set_num_threads(1)
import dgemma_compile as dg
from dgemma_compile import sampler as _sampler
R.update(file=dg.__file__, scheme=getattr(_sampler, "SCHEME", "?"), torch=torch.__version__,
         threads=torch.get_num_threads())
def demo():
    from dgemma_compile.demo import DEMO_MODEL, tasks
    from dgemma_compile.text import encode_prompt
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    prompts = [p for _, p, _ in tasks.make_split("heldout", A["prompts"], seed=0)]
    ids = [encode_prompt(tok, p, bos_token_id=model.config.bos_token_id) for p in prompts]
    return model, tok, tasks, prompts, ids
'''

DEMO_B1 = TORCH + r'''
model, tok, tasks, prompts, ids = demo()
cfg = model.generation_config
fixed = cfg.replace(stop_early=False, max_denoising_steps=A["fixed_steps"])
gen = dg.build(model, dg.CompileOptions(max_seq_len=256))
R["warmup_s"] = gen.warmup(1, cfg)
for c in (cfg, fixed):  # untimed
    gen.generate([ids[0]], c, seed=0)
for name, c in (("adaptive", cfg), ("fixed", fixed)):
    walls, toks, seqs, passes, right = [], 0, [], 0, 0
    for i, x in enumerate(ids):
        t0 = time.perf_counter()
        out = gen.generate([x], c, seed=i)
        walls.append(time.perf_counter() - t0)
        st = out.stats[0]
        toks += st.num_tokens
        passes += st.decoder_passes
        seqs.append(list(out.sequences[0]))
        right += tasks.check(prompts[i], tok.decode(out.sequences[0], skip_special_tokens=True))
    R[name] = dict(tok_s=toks / sum(walls), tokens=toks, wall_s=sum(walls), p50_ms=statistics.median(walls) * 1e3,
                   tok_per_fwd=toks / max(passes, 1), exact=right / len(ids), seqs=seqs)
done()
'''

DEMO_B8 = TORCH + r'''
model, tok, tasks, prompts, ids = demo()
cfg = model.generation_config
fixed = cfg.replace(stop_early=False, max_denoising_steps=A["fixed_steps"])
gen = dg.build(model, dg.CompileOptions(max_seq_len=256))
R["warmup_s"] = gen.warmup(8, cfg)
batch, seeds = ids[:8], list(range(8))
for name, c in (("adaptive", cfg), ("fixed", fixed)):
    gen.generate(batch, c, seed=seeds)  # untimed
    rates, walls = [], []
    for _ in range(A["calls"]):
        t0 = time.perf_counter()
        out = gen.generate(batch, c, seed=seeds)
        walls.append(time.perf_counter() - t0)
        rates.append(sum(st.num_tokens for st in out.stats) / walls[-1])
    R[name] = dict(tok_s=statistics.median(rates), call_ms=statistics.median(walls) * 1e3,
                   seqs=[list(s) for s in out.sequences])
done()
'''

SCALED_B1 = TORCH + r'''
model = dg.load(A["checkpoint"])
cfg = model.generation_config.replace(stop_early=False, max_denoising_steps=A["fixed_steps"],
                                      max_new_tokens=A["new_tokens"])
g = torch.Generator().manual_seed(0)
prompt = torch.randint(3, model.config.vocab_size, (A["prompt_len"],), generator=g).tolist()
gen = dg.build(model, dg.CompileOptions(max_seq_len=A["max_seq_len"]))
R["warmup_s"] = gen.warmup(1, cfg)
t0 = time.perf_counter()
gen.generate([prompt], cfg, seed=0)  # untimed
first = time.perf_counter() - t0
n = A["requests"]
if first * n > A["budget_s"]:
    n = max(1, int(A["budget_s"] // first))
    R["note"] = f"{n} of {A['requests']} requests (a request took {first:.1f} s, budget {A['budget_s']} s)"
walls, toks, seqs = [], 0, []
for i in range(n):
    t0 = time.perf_counter()
    out = gen.generate([prompt], cfg, seed=i)
    walls.append(time.perf_counter() - t0)
    toks += out.stats[0].num_tokens
    seqs.append(list(out.sequences[0]))
R["fixed"] = dict(tok_s=toks / sum(walls), request_s=statistics.median(walls), tokens=toks, requests=n, seqs=seqs)
done()
'''

ENGINE = TORCH + r'''
import importlib
runtime = importlib.import_module(os.environ["BEFORE_AFTER_RUNTIME"])  # dgemma_compile.runtime, or dgemma_runtime
Request, build_engine = runtime.Request, runtime.build_engine
R["runtime"] = runtime.__file__
model, tok, tasks, prompts, ids = demo()
cfg = model.generation_config
t0 = time.perf_counter()
engine = build_engine(model, max_batch=8, max_seq_len=256)
R["engine_build_s"] = time.perf_counter() - t0
gen = dg.build(model, dg.CompileOptions(max_seq_len=256))
R["offline_warmup_s"] = gen.warmup(1, cfg)

def via_engine(i):
    final = {}
    def on_event(e):
        if e.finish_reason is not None and "t" not in final:
            final["t"], final["reason"] = time.perf_counter(), e.finish_reason
    req = Request(prompt=list(ids[i]), config=cfg, seed=i, on_event=on_event)
    t0 = time.perf_counter()
    engine.submit(req)
    while not engine.idle():
        engine.step()
    return final["t"] - t0, list(req.sequence), final["reason"]

def offline(i):
    t0 = time.perf_counter()
    out = gen.generate([ids[i]], cfg, seed=i)
    return time.perf_counter() - t0, list(out.sequences[0])

for i in range(2):  # untimed
    via_engine(i); offline(i)
eng, off, same, reasons = [], [], 0, {}
for i in range(len(ids)):
    if i % 2:
        o = offline(i); e = via_engine(i)
    else:
        e = via_engine(i); o = offline(i)
    eng.append(e[0]); off.append(o[0]); same += e[1] == o[1]; reasons[e[2]] = reasons.get(e[2], 0) + 1
R.update(engine_ms=statistics.median(eng) * 1e3, offline_ms=statistics.median(off) * 1e3,
         ratio=statistics.median(eng) / statistics.median(off),
         paired_ratio=statistics.median(a / b for a, b in zip(eng, off)), requests=len(ids),
         engine_equals_offline=same, finish=reasons)
engine.shutdown()
done()
'''

SERVE = LIGHT + r'''
import asyncio, importlib.util, re, signal, socket, subprocess, tempfile
import httpx
spec = importlib.util.spec_from_file_location("_tasks", A["tasks_py"])  # pure Python: no torch in this client
tasks = importlib.util.module_from_spec(spec); spec.loader.exec_module(tasks)
prompts = [p for _, p, _ in tasks.make_split("heldout", A["prompts"], seed=0)]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
url = f"http://127.0.0.1:{port}"
log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
cmd = [sys.executable, "-m", "dgemma_compile.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *A["flags"]]
R["server_cmd"] = " ".join(["python"] + cmd[1:])
t0 = time.perf_counter()
proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)

def logtext():
    with open(log.name) as f:
        return f.read()

def body(i, max_tokens):
    b = {"prompt": prompts[i % len(prompts)], "seed": i % len(prompts)}
    if max_tokens is not None:
        b["max_tokens"] = max_tokens
    return b

def vmhwm():
    try:
        for line in open(f"/proc/{proc.pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None

async def level(n, seconds=None, per_client=None, max_tokens=None):
    lat, toks, failed = [], 0, 0
    async with httpx.AsyncClient(base_url=url, timeout=300, trust_env=False,
                                 limits=httpx.Limits(max_connections=n + 4)) as client:
        counter = iter(range(10**9))
        start = time.perf_counter()
        async def worker():
            nonlocal toks, failed
            k = 0
            while (time.perf_counter() - start < seconds) if seconds is not None else (k < per_client):
                k += 1
                i = next(counter)
                t = time.perf_counter()
                try:
                    r = await client.post("/v1/completions", json=body(i, max_tokens))
                except httpx.HTTPError:
                    failed += 1
                    continue
                if r.status_code != 200:
                    failed += 1
                    continue
                lat.append(time.perf_counter() - t)
                toks += r.json()["usage"]["completion_tokens"]
        await asyncio.gather(*(worker() for _ in range(n)))
        elapsed = time.perf_counter() - start
    return dict(clients=n, requests=len(lat), failed=failed, elapsed_s=elapsed, tok_s=toks / elapsed,
                req_s=len(lat) / elapsed, p50_ms=statistics.median(lat) * 1e3 if lat else None)

try:
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
        line_t = health_t = None
        while True:
            if proc.poll() is not None:
                raise SystemExit("dgemma serve exited early:\n" + logtext()[-3000:])
            if time.perf_counter() - t0 > A["start_timeout"]:
                raise SystemExit(f"dgemma serve not up after {A['start_timeout']} s:\n" + logtext()[-3000:])
            if line_t is None and "dgemma: serving" in logtext():
                line_t = time.perf_counter() - t0
            try:
                if client.get("/health").status_code == 200:
                    health_t = time.perf_counter() - t0
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = client.post("/v1/completions", json=body(0, 16))
        R["first_answer_s"] = time.perf_counter() - t0
        R["first_status"] = r.status_code
        text = logtext()
        line_t = line_t if line_t is not None else (health_t if "dgemma: serving" in text else None)
        R.update(serving_line_s=line_t, health_s=health_t)
        m = [ln for ln in text.splitlines() if "dgemma: serving" in ln]
        R["serving_line"] = m[0] if m else None
        s = re.search(r"setup_s=([0-9.]+)", text)
        R["setup_s"] = float(s.group(1)) if s else None
        if A["warm_levels"]:
            t = time.perf_counter()
            for n in A["warm_levels"]:  # every batch size compiles (the new engine: on first use)
                asyncio.run(level(n, per_client=2, max_tokens=16))
                asyncio.run(level(n, per_client=1, max_tokens=None))
            R["warm_s"] = time.perf_counter() - t
        if A["c1_requests"]:
            lat = []
            for i in range(A["c1_requests"]):
                t = time.perf_counter()
                r = client.post("/v1/completions", json=body(i, 16))
                lat.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
            lat.sort()
            p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
            R["c1"] = dict(p50_ms=statistics.median(lat) * 1e3, p90_ms=p90 * 1e3, min_ms=lat[0] * 1e3,
                           requests=len(lat))
        if A["c16_seconds"]:
            asyncio.run(level(16, seconds=min(3.0, A["c16_seconds"])))  # steady state before the window
            R["c16"] = asyncio.run(level(16, seconds=A["c16_seconds"]))
    R["server_hwm_mb"] = vmhwm()
    R["compile_lines"] = [ln for ln in logtext().splitlines() if "compil" in ln.lower()][:12]
finally:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill(); proc.wait()
    os.unlink(log.name)
done()
'''

COLD_GENERATE = LIGHT + r'''
import re, subprocess
t0 = time.perf_counter()
p = subprocess.run([sys.executable, "-m", "dgemma_compile.cli", "generate", A["prompt"]], capture_output=True,
                   text=True)
R["wall_s"] = time.perf_counter() - t0
R["rc"] = p.returncode
R["answer"] = p.stdout.strip()
R["stats"] = (p.stderr.strip().splitlines() or [""])[-1]
m = re.search(r"compile_s=([0-9.]+)", p.stderr)
R["compile_s"] = float(m.group(1)) if m else None
R["child_maxrss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
if p.returncode:
    R["error"] = p.stderr[-2000:]
done()
'''

SNIPPETS = {"demo_b1": DEMO_B1, "demo_b8": DEMO_B8, "scaled_b1": SCALED_B1, "engine": ENGINE,
            "serve_default": SERVE, "serve_16": SERVE, "cold_generate": COLD_GENERATE, "cold_serve": SERVE}


# ----- the orchestrator --------------------------------------------------------------------------------------------
def _git(tree: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def tree_info(tree: Path, dirs: list[str]) -> dict:
    """The tree's commit (`git rev-parse --short HEAD`) and its uncommitted changes under `dirs`."""
    dirty = _git(tree, "status", "--porcelain", "--untracked-files=no", "--", *dirs)
    return dict(path=str(tree), commit=_git(tree, "rev-parse", "--short", "HEAD").strip() or "unknown",
                subject=_git(tree, "log", "-1", "--format=%s").strip(),
                dirty=[ln[3:] for ln in dirty.splitlines() if len(ln) > 3])


def packages(tree: Path) -> dict[str, Path]:
    """The import packages of a tree: dgemma_compile/, plus those its pyproject.toml maps with setuptools'
    package-dir (after the redesign: `dgemma_runtime` = runtime/, which `PYTHONPATH=<tree>` alone would not find;
    the venv's editable install would then serve /work/main's copy to both trees)."""
    import tomllib

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


def runtime_package(pkgs: dict[str, Path]) -> str:
    """Where the serving engine lives: `dgemma_runtime` (top-level runtime/) or `dgemma_compile.runtime`."""
    return "dgemma_runtime" if "dgemma_runtime" in pkgs else "dgemma_compile.runtime"


class Runner:
    """Runs worker snippets for each side with `PYTHONPATH` = the side's import root (its copy, or links to the tree
    in place), from a neutral cwd."""

    def __init__(self, roots: dict[str, Path], pkgs: dict[str, dict[str, Path]], workdir: Path, log=sys.stderr):
        self.roots, self.pkgs, self.workdir, self.log = roots, pkgs, workdir, log

    def env(self, side: str, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(self.roots[side])
        env["OMP_NUM_THREADS"] = "1"
        env["BEFORE_AFTER_ROOTS"] = json.dumps(sorted({str(self.roots[side])} |
                                                      {str(p.resolve()) for p in self.pkgs[side].values()}))
        env["BEFORE_AFTER_RUNTIME"] = runtime_package(self.pkgs[side])
        env.pop("PYTHONSTARTUP", None)
        env.update(extra or {})
        return env

    def origin(self, side: str) -> dict[str, str]:
        """Where each package of `side` resolves in its workers (found, not executed)."""
        code = ("import importlib.util as u, json, sys; missing = [m for m in ('torch', 'httpx') if u.find_spec(m) is "
                "None]; print(json.dumps({'missing': missing} if missing else {n: u.find_spec(n).origin for n in "
                "sys.argv[1:]}))")
        p = subprocess.run([sys.executable, "-c", code, *self.pkgs[side]], cwd=self.workdir, env=self.env(side),
                           capture_output=True, text=True, timeout=60)
        return json.loads(p.stdout.strip() or "{}")

    def run(self, name: str, side: str, args: dict, timeout: float, env: dict | None = None) -> dict:
        start = time.perf_counter()
        err = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, "-c", SNIPPETS[name], json.dumps(args)], cwd=self.workdir,
                                env=self.env(side, env), stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
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
                tail = err.read().strip().splitlines()[-6:]
                res = {"error": f"exit {proc.returncode}: " + " | ".join(tail)[-600:]}
        res["worker_s"] = time.perf_counter() - start
        expected = str(self.roots[side] / "dgemma_compile")
        if "file" in res and not res["file"].startswith(expected):
            raise SystemExit(f"{name} {side}: imported {res['file']}, not the tree's {expected}")
        if res.get("foreign"):
            res["error"] = f"modules from outside the {side} tree: {', '.join(res['foreign'][:4])}"
        status = "ok" if "error" not in res else res["error"][:200]
        print(f"  {name:14s} {side:6s} {res['worker_s']:6.1f} s  {status}", file=self.log, flush=True)
        return res


def plan(args: argparse.Namespace, roots: dict[str, Path]) -> tuple[dict[str, dict], dict[str, float]]:
    """Worker arguments and timeouts per measurement."""
    q = args.quick
    n = args.prompts or (8 if q else 50)
    tasks_py = {s: str(roots[s] / "dgemma_compile" / "demo" / "tasks.py") for s in SIDES}  # pure Python
    serve = dict(prompts=max(n, 32), start_timeout=300, tasks_py=None)
    compile_flag = [] if args.serve_compile == "none" else ["--compile", args.serve_compile]
    m = {
        "demo_b1": dict(prompts=n, fixed_steps=8),
        "demo_b8": dict(prompts=8, fixed_steps=8, calls=3 if q else 10),
        "scaled_b1": dict(fixed_steps=8, prompt_len=256, new_tokens=256, max_seq_len=512, requests=5, budget_s=120),
        "engine": dict(prompts=6 if q else 20),
        "serve_default": dict(serve, flags=compile_flag, warm_levels=[8, 4, 2, 1], c1_requests=10 if q else 30, c16_seconds=0),
        "serve_16": dict(serve, flags=["--max-batch", "16", "--max-seq-len", "256", *compile_flag], warm_levels=[16, 8, 4, 2, 1],
                         c1_requests=10 if q else 30, c16_seconds=5 if q else args.duration),
        "cold_generate": dict(prompt="sort 3 1 2 9 5="),
        "cold_serve": dict(serve, flags=[], warm_levels=[], c1_requests=0, c16_seconds=0, start_timeout=480),
    }
    timeouts = {"demo_b1": 600, "demo_b8": 600, "scaled_b1": 420, "engine": 600, "serve_default": 600,
                "serve_16": 600, "cold_generate": 480, "cold_serve": 540}
    for k in ("serve_default", "serve_16", "cold_serve"):
        m[k]["tasks_py"] = tasks_py  # per side, resolved in main
    return m, timeouts


def cold_env(cache: Path) -> dict:
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "0", "TRITON_CACHE_DIR": str(cache / "triton")}


def scaled_checkpoint(after: Path, log) -> tuple[str | None, str]:
    """The `scaled` checkpoint written by the after tree's bench/models.py (once; cached under /tmp), or None and
    why not."""
    models = after / "bench" / "models.py"
    if "def scaled_checkpoint" not in (models.read_text() if models.exists() else ""):
        return None, "skipped: the after tree's bench/models.py has no scaled_checkpoint"
    code = "from bench.models import scaled_checkpoint; print(scaled_checkpoint())"
    env = dict(os.environ, PYTHONPATH=str(after), OMP_NUM_THREADS="1")
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], cwd=after, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        return None, f"skipped: building the scaled checkpoint failed: {p.stderr.strip().splitlines()[-1:]}"
    path = p.stdout.strip().splitlines()[-1]
    print(f"  scaled checkpoint {path} ({time.perf_counter() - t:.0f} s)", file=log, flush=True)
    return path, ""


# ----- report ------------------------------------------------------------------------------------------------------
def _get(res: dict, path: str):
    x = res
    for k in path.split("."):
        if not isinstance(x, dict) or x.get(k) is None:
            return None
        x = x[k]
    return x


METRICS = [  # (measurement, path, label, unit, better)
    ("demo_b1", "adaptive.tok_s", "demo b1 adaptive", "tok/s", "higher"),
    ("demo_b1", "adaptive.p50_ms", "demo b1 adaptive, request p50", "ms", "lower"),
    ("demo_b1", "fixed.tok_s", "demo b1 fixed 8 steps", "tok/s", "higher"),
    ("demo_b1", "fixed.p50_ms", "demo b1 fixed 8 steps, request p50", "ms", "lower"),
    ("demo_b8", "adaptive.tok_s", "demo b8 adaptive (one call of 8)", "tok/s", "higher"),
    ("demo_b8", "fixed.tok_s", "demo b8 fixed 8 steps (one call of 8)", "tok/s", "higher"),
    ("scaled_b1", "fixed.tok_s", "scaled b1 fixed 8 steps", "tok/s", "higher"),
    ("scaled_b1", "fixed.request_s", "scaled b1 fixed 8 steps, request", "s", "lower"),
    ("engine", "engine_ms", "engine: lone request submit -> final event p50", "ms", "lower"),
    ("engine", "offline_ms", "offline gen.generate, same request p50", "ms", "lower"),
    ("engine", "ratio", "engine / offline (p50s; target <= 1.25 after)", "x", "lower"),
    ("engine", "paired_ratio", "engine / offline (median per-request ratio)", "x", "lower"),
    ("serve_default", "c1.p50_ms", "serve default flags: c=1 latency p50", "ms", "lower"),
    ("serve_default", "c1.p90_ms", "serve default flags: c=1 latency p90", "ms", "lower"),
    ("serve_default", "first_answer_s", "serve default flags: start -> first answer (warm cache)", "s", "lower"),
    ("serve_default", "setup_s", "serve default flags: its setup_s (build + compile before listening)", "s", "lower"),
    ("serve_16", "c1.p50_ms", "serve 16/256: c=1 latency p50", "ms", "lower"),
    ("serve_16", "c16.tok_s", "serve 16/256: c=16 throughput", "tok/s", "higher"),
    ("serve_16", "c16.req_s", "serve 16/256: c=16 requests/s", "req/s", "higher"),
    ("serve_16", "c16.p50_ms", "serve 16/256: c=16 latency p50", "ms", "lower"),
    ("serve_16", "first_answer_s", "serve 16/256: start -> first answer (warm cache)", "s", "lower"),
    ("serve_16", "setup_s", "serve 16/256: its setup_s (build + compile before listening)", "s", "lower"),
    ("serve_16", "warm_s", "serve 16/256: warm-up traffic (sizes compiling on first use)", "s", "lower"),
    ("demo_b1", "maxrss_mb", "peak RSS: demo b1 worker", "MB", "lower"),
    ("demo_b8", "maxrss_mb", "peak RSS: demo b8 worker", "MB", "lower"),
    ("scaled_b1", "maxrss_mb", "peak RSS: scaled b1 worker", "MB", "lower"),
    ("engine", "maxrss_mb", "peak RSS: engine worker (engine + offline build)", "MB", "lower"),
    ("serve_default", "server_hwm_mb", "peak RSS: server, default flags", "MB", "lower"),
    ("serve_16", "server_hwm_mb", "peak RSS: server 16/256", "MB", "lower"),
    ("demo_b1", "warmup_s", "compile: demo gen.warmup(1) (warm Inductor cache)", "s", "lower"),
    ("demo_b8", "warmup_s", "compile: demo gen.warmup(8) (warm Inductor cache)", "s", "lower"),
    ("engine", "engine_build_s", "compile: build_engine(max_batch=8) (warm Inductor cache)", "s", "lower"),
    ("cold_generate", "wall_s", "cold start: `dgemma generate` to exit (empty cache)", "s", "lower"),
    ("cold_generate", "compile_s", "cold start: its compile_s", "s", "lower"),
    ("cold_generate", "child_maxrss_mb", "peak RSS: cold `dgemma generate`", "MB", "lower"),
    ("cold_serve", "first_answer_s", "cold start: `dgemma serve` start -> first answer (empty cache)", "s", "lower"),
    ("cold_serve", "setup_s", "cold start: its setup_s", "s", "lower"),
]


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def token_check(results: dict, name: str, key: str) -> str | None:
    rb = [r for r in results.get(name, {}).get("before", []) if _get(r, key + ".seqs") is not None]
    ra = [r for r in results.get(name, {}).get("after", []) if _get(r, key + ".seqs") is not None]
    if not rb or not ra:
        return None
    b, a = rb[0][key]["seqs"], ra[0][key]["seqs"]
    differ = sum(x != y for x, y in zip(b, a)) + abs(len(b) - len(a))
    stable = {s: all(r[key]["seqs"] == rs[0][key]["seqs"] for r in rs) for s, rs in (("before", rb), ("after", ra))}
    line = f"{'yes' if differ == 0 else 'no'} ({differ} of {max(len(a), len(b))} requests differ)"
    unstable = [s for s, ok in stable.items() if not ok]
    if unstable:
        line += f"; NOT stable across rounds in: {', '.join(unstable)}"
    return line


def report(args, argv, trees, info, results, started, notes, load_start) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    cpu = "cpu"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        kb = int(next(ln for ln in meminfo if ln.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass

    def ver(p):
        try:
            return importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    def first(side, key):
        for rs in results.values():
            for r in rs.get(side, []):
                if r.get(key) is not None:
                    return r[key]
        return "?"

    cmd = "python -m bench.before_after " + " ".join(argv)
    L = [f"# Issue 23 item 7: before / after the one-step redesign, side by side (CPU, {now:%Y-%m-%d})", "",
         f"- command: `{cmd}`" + (" (--quick: 1 round, few prompts, no scaled, no cold start)" if args.quick else ""),
         f"- machine: {cpu} ({os.cpu_count()} logical CPUs{mem}), shared with other engineers; load average 1/5/15 "
         f"min at start {load_start}, at end {_load()}",
         f"- versions: python {platform.python_version()}, torch {ver('torch')}, transformers {ver('transformers')}, "
         f"httpx {ver('httpx')}, fastapi {ver('fastapi')}, uvicorn {ver('uvicorn')}",
         f"- workers: one fresh `python -c` subprocess per measurement, tree and round, `PYTHONPATH=<tree>`, "
         f"`OMP_NUM_THREADS=1` and `torch.set_num_threads(1)` (threads seen: before {first('before', 'threads')}, "
         f"after {first('after', 'threads')}); rounds interleaved ABAB (before then after, per measurement); "
         f"{args.rounds} round(s); started {started}, finished {now:%Y-%m-%d %H:%M} UTC"]
    for side in SIDES:
        t = info[side]
        dirty = f" +uncommitted changes in {', '.join(t['dirty'])}" if t["dirty"] else ""
        where = "in place (`--no-snapshot`)" if args.no_snapshot else "from copies taken at the start"
        pk = ", ".join(f"`{n}` = {Path(p).relative_to(t['path'])}/" for n, p in t["packages"].items())
        L.append(f"- {side}: `{t['path']}` at `{t['commit']}`{dirty} ({t['subject']}); packages {pk}, run {where}, "
                 f"every worker's modules checked to come from there; sampler.SCHEME `{first(side, 'scheme')}`")
    L += ["", "Medians over rounds; after/before = median(after) / median(before), paired = median over rounds of "
          "after / before of the same round (cancels a slow spell that hit one round); for \"lower\" rows < 1 is "
          "better, for \"higher\" rows > 1 is better. Per-round values in the last columns.", "",
          "| measurement | unit | better | before | after | after/before | paired | before per round "
          "| after per round |",
          "|---|---|---|---:|---:|---:|---:|---|---|"]
    for name, path, label, unit, better in METRICS:
        if name not in results:
            continue
        vb = [_get(r, path) for r in results[name]["before"]]
        va = [_get(r, path) for r in results[name]["after"]]
        mb, ma = _median(vb), _median(va)
        if mb is None and ma is None:
            continue
        ratio = f"{ma / mb:.2f}x" if mb and ma is not None else "n/a"
        pairs = _median([a / b for a, b in zip(va, vb) if a is not None and b])
        paired = f"{pairs:.2f}x" if pairs is not None else "n/a"
        L.append(f"| {label} | {unit} | {better} | {_fmt(mb)} | {_fmt(ma)} | {ratio} | {paired} | "
                 f"{', '.join(_fmt(v) for v in vb)} | {', '.join(_fmt(v) for v in va)} |")
    L += ["", "## Tokens", ""]
    for name, key, label in (("demo_b1", "adaptive", "demo b1 adaptive"), ("demo_b1", "fixed", "demo b1 fixed 8 steps"),
                             ("demo_b8", "adaptive", "demo b8 adaptive"), ("demo_b8", "fixed", "demo b8 fixed 8 steps"),
                             ("scaled_b1", "fixed", "scaled b1 fixed")):
        line = token_check(results, name, key)
        if line is not None:
            L.append(f"- {label}: tokens identical between trees: {line}")
    for side in SIDES:
        ex = [_get(r, "adaptive.exact") for r in results.get("demo_b1", {}).get(side, [])]
        ex = [x for x in ex if x is not None]
        if ex:
            L.append(f"- demo b1 adaptive exact match ({side}): {100 * ex[0]:.1f}%")
        eq = [(r.get("engine_equals_offline"), r.get("requests")) for r in results.get("engine", {}).get(side, [])
              if r.get("requests")]
        if eq:
            L.append(f"- engine tokens == offline tokens ({side}): " + ", ".join(f"{a}/{b}" for a, b in eq))
    L.append("- the trees' sampler schemes differ (item 5, self-conditioning as an embedding), so token differences "
             "between trees are expected where SCHEME differs; within a tree every round must agree."
             if first("before", "scheme") != first("after", "scheme") else
             "- both trees run the same sampler scheme: tokens must be identical.")
    settings = [
        "- demo: `dg.build(model, CompileOptions(max_seq_len=256))` (default batch buckets), `gen.warmup(b)` then "
        "one untimed call per config; held-out prompts `make_split(\"heldout\", N, seed=0)` "
        f"(N={plan_args(results, 'demo_b1', 'prompts')}), prompt i with seed i; adaptive = the checkpoint's "
        "generation config; fixed = `stop_early=False, max_denoising_steps=8` (eos still ends a request); "
        "tok/s = generated tokens / summed wall of the calls (b1), median over calls of one 8-prompt call (b8)",
        "- scaled: bench/models.py `scaled` (random weights, bf16, canvas 256), written once by the after tree's "
        "builder, read by both; prompt of 256 random ids, 256 new tokens, fixed 8 steps, batch 1, "
        "`CompileOptions(max_seq_len=512)`",
        "- engine: `build_engine(model, max_batch=8, max_seq_len=256)` (compiled, warmed by the call; no tokenizer), "
        "2 untimed requests, then per prompt one request alone: submit -> final event with `engine.step()` called "
        "in the worker's thread until `engine.idle()`; alternating with the offline `gen.generate` of the same "
        "request (prompt, checkpoint config, seed) on `build(model, CompileOptions(max_seq_len=256))` warmed at 1",
        "- serve: the worker starts `python -m dgemma_compile.cli serve --host 127.0.0.1 --port P [flags]`, polls "
        "/health every 0.1 s, sends the first request at once (start -> first answer, warm Inductor cache); warm-up: "
        "at each concurrency of `warm_levels` (max-batch down to 1) two max_tokens=16 requests and one default "
        "request per client; c=1: sequential /v1/completions through one httpx client, max_tokens 16, seed = prompt "
        "index; c=16: 3 s untimed then a window of 16 concurrent clients, the checkpoint's config (as "
        "bench/serve.py), tokens from usage.completion_tokens / window",
        "- cold start: `TORCHINDUCTOR_CACHE_DIR` a fresh temp dir (FX graph and AOTAutograd caches on, remote caches "
        "off, `TRITON_CACHE_DIR` inside it); `python -m dgemma_compile.cli generate \"sort 3 1 2 9 5=\"` wall to "
        "exit; `... serve` (default flags) start -> first answered request"]
    ran = set(results)
    wanted = [{"demo_b1", "demo_b8"}, {"scaled_b1"}, {"engine"}, {"serve_default", "serve_16"},
              {"cold_generate", "cold_serve"}]
    L += ["", "## Settings", ""] + [line for line, names in zip(settings, wanted) if names & ran]
    lines = []
    for name, rs in results.items():
        for side in SIDES:
            for k, r in enumerate(rs[side]):
                if r.get("error"):
                    lines.append(f"- {name} {side} round {k + 1}: n/a ({r['error']})")
                if r.get("note"):
                    lines.append(f"- {name} {side} round {k + 1}: {r['note']}")
    for side in SIDES:
        for name in ("serve_16", "cold_serve"):
            for r in results.get(name, {}).get(side, [])[:1]:
                if r.get("serving_line"):
                    lines.append(f"- {name} {side} server line: `{r['serving_line']}`")
                if r.get("compile_lines"):
                    lines.append(f"- {name} {side} compile log: " + " / ".join(f"`{x}`" for x in r["compile_lines"]))
        for r in results.get("cold_generate", {}).get(side, [])[:1]:
            lines.append(f"- cold_generate {side}: answer `{r.get('answer')}`, stats `{r.get('stats')}`")
    lines += [f"- {n}" for n in notes]
    if lines:
        L += ["", "## Notes", ""] + lines
    wall = []
    for name, rs in results.items():
        for side in SIDES:
            wall += [r.get("worker_s", 0) for r in rs[side]]
    L += ["", f"Worker time in all: {sum(wall) / 60:.1f} min over {len(wall)} workers.", ""]
    return "\n".join(L)


_PLAN_ARGS: dict[str, dict] = {}


def plan_args(results, name, key):
    return _PLAN_ARGS.get(name, {}).get(key, "?")


def _load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.before_after", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the tree before the redesign")
    p.add_argument("--after", type=Path, required=True, help="the tree after it")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="1 round, few prompts, 5 s at c=16, no scaled model, no cold start (~4-5 min)")
    p.add_argument("--prompts", type=int, default=None, help="demo b1 prompts (default 50; 8 with --quick)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of the c=16 window (default 20)")
    p.add_argument("--only", default=None, help="comma list of measurements to run (default: all)")
    p.add_argument("--skip", default="", help="comma list of measurements to leave out")
    p.add_argument("--serve-compile", choices=("always", "auto", "none"), default="always",
                   help="the servers' --compile (default always: both trees serve compiled steps, compiled or loaded "
                        "before listening; auto: a cold tree serves eagerly while a background compile runs, which the "
                        "worker's shutdown cuts short, so it never fills the cache; none: no flag, for trees before "
                        "`--compile` existed)")
    p.add_argument("--no-snapshot", action="store_true",
                   help="run the trees in place (default: copy each tree's dgemma_compile/ to a temp dir at the start, "
                        "so that edits made to a tree during the run do not reach later workers)")
    p.add_argument("--output", type=Path, default=None, help="results file (default bench/results/...)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    sources = {"before": args.before.resolve(), "after": args.after.resolve()}
    for side in SIDES:
        if not (sources[side] / "dgemma_compile" / "__init__.py").exists():
            raise SystemExit(f"--{side} {sources[side]}: no dgemma_compile/ package there")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_start = _load()
    scratch = Path(tempfile.mkdtemp(prefix="dgemma_before_after_"))
    atexit.register(shutil.rmtree, scratch, True)  # also when a check below stops the run
    workdir = scratch / "cwd"  # neutral cwd: `python -c` and `-m` put it first on sys.path
    workdir.mkdir()
    pkgs = {side: packages(sources[side]) for side in SIDES}
    dirs = {side: [str(p.relative_to(sources[side])) for p in pkgs[side].values()] for side in SIDES}
    info = {side: tree_info(sources[side], dirs[side]) for side in SIDES}
    roots = {}
    for side in SIDES:  # one import root per side holding each of its packages under its import name
        roots[side] = scratch / side
        roots[side].mkdir()
        for name, src in pkgs[side].items():
            if not args.no_snapshot:  # as it is now, uncommitted changes included (the demo model lives inside it)
                shutil.copytree(src, roots[side] / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                (roots[side] / name).symlink_to(src, target_is_directory=True)
        info[side]["packages"] = {n: str(p) for n, p in pkgs[side].items()}
    runner = Runner(roots, pkgs, workdir)
    for side in SIDES:
        info[side]["origin"] = origin = runner.origin(side)
        if origin.get("missing"):
            raise SystemExit(f"{sys.executable} lacks {' '.join(origin['missing'])}: run it in the project's venv")
        for name in pkgs[side]:
            if not str(origin.get(name)).startswith(str(roots[side] / name)):
                raise SystemExit(f"{side}: {name} resolves to {origin.get(name)!r}, not to {roots[side] / name}")
        print(f"{side}: {sources[side]} at {info[side]['commit']} (packages {', '.join(pkgs[side])}; runs from "
              f"{roots[side]})", file=sys.stderr)

    worker_args, timeouts = plan(args, roots)
    notes = []
    _PLAN_ARGS.update(worker_args)
    rounds = ["demo_b1", "demo_b8", "scaled_b1", "engine", "serve_default", "serve_16"]
    once = ["cold_generate", "cold_serve"]
    skip = {s for s in args.skip.split(",") if s}
    if args.quick:
        skip |= {"scaled_b1", "cold_generate", "cold_serve"}
    if args.only:
        keep = {s for s in args.only.split(",") if s}
        unknown = keep - set(rounds) - set(once)
        if unknown:
            raise SystemExit(f"--only: unknown measurement(s) {sorted(unknown)}; choose from {rounds + once}")
        skip |= (set(rounds) | set(once)) - keep
    rounds = [m for m in rounds if m not in skip]
    once = [m for m in once if m not in skip]
    if args.quick:
        notes.append("--quick: scaled model and cold starts skipped")
    if "scaled_b1" in rounds:
        path, why = scaled_checkpoint(sources["after"], sys.stderr)
        same = all((sources[s] / "bench" / "models.py").exists() for s in SIDES) and \
            (sources["before"] / "bench" / "models.py").read_text() == \
            (sources["after"] / "bench" / "models.py").read_text()
        notes.append("bench/models.py " + ("is identical in both trees" if same else "differs between the trees") +
                     "; the scaled checkpoint was written by the after tree's builder and loaded by both")
        if path is None:
            notes.append(f"scaled: {why}")
            rounds.remove("scaled_b1")
        else:
            worker_args["scaled_b1"]["checkpoint"] = path

    results: dict[str, dict[str, list]] = {m: {s: [] for s in SIDES} for m in rounds + once}
    try:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            for m in rounds:
                for side in SIDES:
                    a = dict(worker_args[m])
                    if isinstance(a.get("tasks_py"), dict):
                        a["tasks_py"] = a["tasks_py"][side]
                    results[m][side].append(runner.run(m, side, a, timeouts[m]))
                if m == "scaled_b1" and any("timed out" in (x.get("error") or "") for s in SIDES
                                            for x in results[m][s][-1:]):
                    notes.append("scaled: a worker ran past its timeout (> 2 min per measurement): not run again")
                    rounds = [x for x in rounds if x != "scaled_b1"]
        if once:
            print("cold start (empty Inductor cache)", file=sys.stderr, flush=True)
        for m in once:
            for side in SIDES:
                cache = Path(tempfile.mkdtemp(prefix="dgemma_cold_inductor_"))
                try:
                    a = dict(worker_args[m])
                    if isinstance(a.get("tasks_py"), dict):
                        a["tasks_py"] = a["tasks_py"][side]
                    results[m][side].append(runner.run(m, side, a, timeouts[m], env=cold_env(cache)))
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
    except KeyboardInterrupt:
        notes.append("interrupted: partial results")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for side in SIDES:
        end = tree_info(sources[side], dirs[side])
        if (end["commit"], end["dirty"]) != (info[side]["commit"], info[side]["dirty"]):
            what = f"commit {info[side]['commit']} -> {end['commit']}" if end["commit"] != info[side]["commit"] else \
                f"its uncommitted changes under {', '.join(dirs[side])}"
            notes.append(f"the {side} tree changed during the run ({what}): " +
                         ("the workers ran the snapshot taken at the start" if not args.no_snapshot else
                          "--no-snapshot: later workers may have run the changed code"))

    text = report(args, argv, sources, info, results, started, notes, load_start)
    print(text)
    if not args.no_write:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        out = args.output or RESULTS / f"before_after_cpu_{date}{'_quick' if args.quick else ''}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

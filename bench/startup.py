"""`python -m bench.startup`: start-up cost from the user's point of view, on the demo model: wall time from a
command's start to its first answer and to its exit, with empty caches, warm caches, and in a new venv.

    python -m bench.startup                                        # empty, warm, new-venv (pip: ~1-2 min)
    python -m bench.startup --scenarios warm --skip-new-venv --repeats 3
    python -m bench.startup --scenarios new-venv --new-venv /tmp/dgemma-venv2   # reuse a venv made before
    python -m bench.startup --dry-run                              # the commands and their caches; nothing runs

Commands, each a subprocess (cwd a scratch directory, PYTHONPATH unset, the rest of the environment inherited, so
OMP_NUM_THREADS too when set), timed from just before its start to the first non-blank bytes on its stdout (`first
answer`) and to its exit:

- `dgemma generate "sort 3 1 2 9 5="` (default flags; it streams each block's text on stdout);
- `dgemma generate --prompts-file FILE`: 64 held-out demo prompts (`demo.tasks.make_split("heldout", 64)`), one
  JSONL line `{"prompt": ...}` each (the first answer is the first batch's first line);
- `dgemma serve` (default flags; `--port` only when 8000 is taken): to the response of its first
  `POST /v1/completions` ({"prompt": "sort 3 1 2 9 5=", "max_tokens": 16}, sent once `GET /health` answers), then
  SIGTERM; it has no exit time;
- transformers: `python -c` importing torch and transformers, loading `DiffusionGemmaForBlockDiffusion` and the
  tokenizer from the same checkpoint, `generate` on the same prompt (eager, the checkpoint's generation config, seed
  0), printing the answer: the reference of every ratio;
- `dgemma --help` (time to exit).

Scenarios (`--scenarios`):

- `empty`: every command gets fresh, empty `DGEMMA_CACHE_DIR` (our compile artifacts) and `TORCHINDUCTOR_CACHE_DIR`
  directories of its own, so nothing is cached for it (not even by another command of the run); one run each.
- `warm`: the same directories again (after `empty`, or after one untimed warm-up run of each command when `empty`
  was not asked for); `--repeats` rounds, the commands round-robin in each round (round 1 of every command, then
  round 2, ...), medians reported.
- `new-venv`: the commands of a second venv at another path (made by this script: `python -m venv DIR`,
  `DIR/bin/pip install torch==2.13.0`, `DIR/bin/pip install REPO 'REPO[serve]'`; `--new-venv DIR` reuses one,
  `--skip-new-venv` makes none), with each command's `DGEMMA_CACHE_DIR` of the two scenarios above but a fresh
  `TORCHINDUCTOR_CACHE_DIR`: our cache must survive a new venv and an empty Inductor cache. One run each.

Between scenarios the script waits for the background compiles the previous one started (a prompts file or a
server that found no cached step compiles it in a process that outlives the command), and notes how long.

Before each scenario one untimed `python -c "import torch, transformers, dgemma_compile"` of its venv, so that the OS
file cache holds the libraries for every command alike (it is never dropped: "empty" is about our caches and
Inductor's). The ratio column is first answer / transformers' first answer of the same round (the median over
rounds with `--repeats`). `compile_s=` and `step=` (where the step came from: compiled, loaded or eager) are read
from dgemma generate's stderr stats line when present. Results: markdown in bench/results/startup_cpu_<date>.md
(`--out`), also on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("empty", "warm", "new-venv")
TITLES = {"empty": "empty caches", "warm": "warm, same venv", "new-venv": "new venv at another path"}
PROMPT = "sort 3 1 2 9 5="
N_PROMPTS = 64
MODEL_NAME = "dgemma-demo"  # `dgemma serve`'s model id for the demo model (docs/cli.md)
DEFAULT_PORT = 8000  # `dgemma serve --port`'s default
TORCH_PIN = "torch==2.13.0"
# the issue's targets: first answer of `dgemma generate PROMPT` within this many times transformers' first answer
GENERATE_TARGET = {"empty": 1.5, "warm": 1.0, "new-venv": 1.0}
HELP_TARGET_S = 0.5
STATS = {"compile_s": r"\bcompile_s=([0-9.]+)", "step": r"\bstep=([A-Za-z_-]+)", "ttfb_s": r"\bttfb_s=([0-9.]+)",
         "setup_s": r"\bsetup_s=([0-9.]+)", "step_load_s": r"\bstep_load_s=([0-9.]+)"}
STEP_LOAD_TARGET_S = 1.0  # a warm start loads the compiled step in under a second (the issue)

# transformers' own eager generate, as a user would write it: argv = checkpoint directory, prompt
HF_CODE = """\
import sys
import torch
from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion
from transformers.utils import logging
logging.set_verbosity_error()
logging.disable_progress_bar()
path, prompt = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(path)
model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="auto").eval()
ids = tokenizer(prompt)["input_ids"]
bos = model.config.text_config.bos_token_id
if not ids or ids[0] != bos:
    ids = [bos] + ids
torch.manual_seed(0)
with torch.inference_mode():
    out = model.generate(torch.tensor([ids]))
new = getattr(out, "sequences", out)[0, len(ids):].tolist()
eos = model.generation_config.eos_token_id
eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
cut = next((i for i, t in enumerate(new) if t in eos), len(new))
print(tokenizer.decode(new[:cut], skip_special_tokens=True), flush=True)
"""
PRIME_CODE = "import torch, transformers, dgemma_compile"


# ----- what runs ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Venv:
    name: str
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def dgemma(self) -> Path:
        return self.root / "bin" / "dgemma"


@dataclass(frozen=True)
class Command:
    key: str  # generate, prompts-file, serve, transformers, help
    label: str  # the table's row name
    argv: tuple[str, ...]
    serve_port: int | None = None  # set for `dgemma serve`


KEYS = ("generate", "prompts-file", "serve", "transformers", "help")


def commands(venv: Venv, prompts_file: Path, model_dir: Path, port: int, serve: bool = True) -> list[Command]:
    d = str(venv.dgemma)
    out = [Command("generate", f'`dgemma generate "{PROMPT}"`', (d, "generate", PROMPT)),
           Command("prompts-file", f"`dgemma generate --prompts-file` ({N_PROMPTS} prompts)",
                   (d, "generate", "--prompts-file", str(prompts_file)))]
    if serve:
        flags = () if port == DEFAULT_PORT else ("--port", str(port))
        out.append(Command("serve", "`dgemma serve` to its first answered request", (d, "serve", *flags),
                           serve_port=port))
    out += [Command("transformers", "transformers eager `generate` (python -c)",
                    (str(venv.python), "-c", HF_CODE, str(model_dir), PROMPT)),
            Command("help", "`dgemma --help`", (d, "--help"))]
    return out


@dataclass(frozen=True)
class Layout:
    """Every path of one run under `root` (a fresh temp directory): the scratch cwd with the prompts file, and per
    command its own cache directories."""

    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def prompts_file(self) -> Path:
        return self.work / "prompts.jsonl"

    @property
    def venv(self) -> Path:
        return self.root / "venv2"

    def dgemma_cache(self, key: str) -> Path:
        return self.root / "caches" / key / "dgemma"

    def inductor_cache(self, key: str, scenario: str = "empty") -> Path:
        """`empty` and `warm` share one Inductor directory per command; `new-venv` gets a fresh one."""
        return self.root / "caches" / key / ("inductor-new-venv" if scenario == "new-venv" else "inductor")


@dataclass(frozen=True)
class Step:
    """One subprocess of the plan: a command of a scenario with its two cache directories."""

    scenario: str
    command: Command
    dgemma_cache: Path
    inductor_cache: Path
    round: int = 0
    timed: bool = True  # False: an untimed warm-up run


def plan(scenarios: list[str], layout: Layout, this: Venv, other: Venv | None, repeats: int, port: int,
         serve: bool = True, model_dir: Path | None = None) -> list[Step]:
    """The subprocesses in order: `empty` (one run per command, fresh dirs), `warm` (an untimed warm-up run per
    command first unless `empty` ran, then `repeats` rounds round-robin), `new-venv` (one run per command of `other`,
    the same DGEMMA_CACHE_DIR, a fresh TORCHINDUCTOR_CACHE_DIR; warm-up runs in this venv first unless a scenario
    above filled the caches)."""
    if model_dir is None:
        from dgemma_compile.demo import DEMO_MODEL

        model_dir = Path(DEMO_MODEL)
    mine = commands(this, layout.prompts_file, model_dir, port, serve)
    steps: list[Step] = []
    warmed = False

    def dirs(c: Command, scenario: str) -> tuple[Path, Path]:
        return layout.dgemma_cache(c.key), layout.inductor_cache(c.key, scenario)

    def warm_up() -> None:
        steps.extend(Step("warm-up", c, *dirs(c, "warm"), timed=False) for c in mine)

    if "empty" in scenarios:
        steps += [Step("empty", c, *dirs(c, "empty")) for c in mine]
        warmed = True
    if "warm" in scenarios:
        if not warmed:
            warm_up()
            warmed = True
        steps += [Step("warm", c, *dirs(c, "warm"), round=r) for r in range(repeats) for c in mine]
    if "new-venv" in scenarios and other is not None:
        if not warmed:
            warm_up()
        steps += [Step("new-venv", c, *dirs(c, "new-venv"))
                  for c in commands(other, layout.prompts_file, model_dir, port, serve)]
    return steps


def environment_for(step: Step) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    venv_root = Path(step.command.argv[0]).parent.parent
    env.update(DGEMMA_CACHE_DIR=str(step.dgemma_cache), TORCHINDUCTOR_CACHE_DIR=str(step.inductor_cache),
               VIRTUAL_ENV=str(venv_root), PATH=f"{venv_root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def write_prompts_file(path: Path, n: int = N_PROMPTS) -> None:
    from dgemma_compile.demo.tasks import make_split

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for _, p, _ in make_split("heldout", n, seed=0)))


def serve_port(preferred: int = DEFAULT_PORT) -> int:
    """`preferred` when nothing listens there, else a free port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


# ----- timing -------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    step: Step
    first_s: float | None = None
    exit_s: float | None = None
    status: str = "ok"  # or "n/a (reason)"
    stdout: str = ""
    stderr: str = ""
    fields: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def parse_stats(stderr: str) -> dict[str, str]:
    """`compile_s`, `step`, `ttfb_s`, `setup_s` from the last stderr line that has each (dgemma's stats line, or
    serve's `serving` line)."""
    out = {}
    for line in stderr.splitlines():
        for name, rx in STATS.items():
            m = re.search(rx, line)
            if m:
                out[name] = m.group(1)
    return out


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the process, SIGKILL to its process group (its own session: Inductor's compile workers) after
    `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def time_command(step: Step, cwd: Path, timeout_s: float) -> Run:
    """Wall time from just before the start to the first non-blank stdout bytes and to the exit (waitpid, no
    polling); stderr to a file."""
    run = Run(step)
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(step.command.argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                env=environment_for(step), cwd=cwd, start_new_session=True)
        chunks: list[bytes] = []
        first: list[float] = []

        def read() -> None:
            fd = proc.stdout.fileno()
            while True:
                b = os.read(fd, 65536)
                if not b:
                    return
                if not first and b.strip():
                    first.append(time.perf_counter())
                chunks.append(b)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

        timer = threading.Timer(timeout_s, expire)
        timer.start()
        rc = proc.wait()
        end = time.perf_counter()
        timer.cancel()
        reader.join(10)
        proc.stdout.close()
        err.seek(0)
        run.stderr = err.read().decode("utf-8", "replace")
    run.stdout = b"".join(chunks).decode("utf-8", "replace")
    run.fields = parse_stats(run.stderr)
    if expired.is_set():
        run.status = f"n/a (timeout after {timeout_s:.0f} s)"
    elif rc != 0:
        run.status = f"n/a (exit status {rc})"
    elif not first:
        run.status = "n/a (nothing on stdout)"
    else:
        run.first_s, run.exit_s = first[0] - start, end - start
    return run


def time_serve(step: Step, cwd: Path, timeout_s: float) -> Run:
    """`dgemma serve`: from just before its start to the response of its first POST /v1/completions (sent as soon as
    GET /health answers); then SIGTERM."""
    import httpx

    run = Run(step)
    port = step.command.serve_port
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(step.command.argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env=environment_for(step), cwd=cwd, start_new_session=True)
        try:
            with httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=1.0)) as client:
                while True:
                    if proc.poll() is not None:
                        run.status = f"n/a (exited with status {proc.returncode} before serving)"
                        break
                    if time.perf_counter() - start > timeout_s:
                        run.status = f"n/a (timeout after {timeout_s:.0f} s, not up)"
                        break
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.02)
                if run.ok:
                    up = time.perf_counter() - start
                    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16})
                    answered = time.perf_counter() - start
                    if r.status_code != 200:
                        run.status = f"n/a (HTTP {r.status_code}: {r.text[:200]})"
                    else:
                        run.first_s = answered
                        run.stdout = r.json()["choices"][0]["text"]
                        run.notes.append(f"up (/health) at {up:.2f} s")
        except httpx.HTTPError as e:
            run.status = f"n/a ({type(e).__name__}: {e})"
        finally:
            _stop(proc)
            log.seek(0)
            run.stderr = log.read().decode("utf-8", "replace")
    run.fields = parse_stats(run.stderr)
    return run


def execute(step: Step, cwd: Path, timeout_s: float) -> Run:
    step.dgemma_cache.mkdir(parents=True, exist_ok=True)
    step.inductor_cache.mkdir(parents=True, exist_ok=True)
    run = (time_serve if step.command.serve_port is not None else time_command)(step, cwd, timeout_s)
    what = "warm-up" if not step.timed else f"{step.scenario} r{step.round}"
    print(f"startup: {what} {step.command.key}: "
          + (f"first {run.first_s:.2f} s" if run.first_s is not None else run.status)
          + (f", exit {run.exit_s:.2f} s" if run.exit_s is not None else "")
          + "".join(f", {k}={v}" for k, v in run.fields.items()), file=sys.stderr, flush=True)
    return run


# ----- venvs --------------------------------------------------------------------------------------------------------
def venv_commands(root: Path) -> list[list[str]]:
    pip = str(root / "bin" / "pip")
    return [[sys.executable, "-m", "venv", str(root)], [pip, "install", TORCH_PIN],
            [pip, "install", str(REPO), f"{REPO}[serve]"]]


def make_venv(root: Path, log: Path, timeout_s: float) -> float:
    """Create the second venv (the three commands of `venv_commands`); seconds taken. Raises RuntimeError."""
    start = time.perf_counter()
    with open(log, "w") as fh:
        for argv in venv_commands(root):
            fh.write(f"$ {shlex.join(argv)}\n")
            fh.flush()
            r = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=root.parent)
            if r.returncode != 0:
                raise RuntimeError(f"{shlex.join(argv)} exited with status {r.returncode} (log: {log})")
    return time.perf_counter() - start


def venv_versions(venv: Venv) -> str:
    code = ("import sys, torch, transformers; from importlib.metadata import version; "
            "print(f'python {sys.version.split()[0]}, torch {torch.__version__}, transformers '"
            "f'{transformers.__version__}, dgemma-compile {version(\"dgemma-compile\")}')")
    r = subprocess.run([str(venv.python), "-c", code], capture_output=True, text=True, timeout=300)
    return r.stdout.strip() or f"? ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})"


def prime(venv: Venv, cwd: Path) -> None:
    """Untimed import of the libraries, so that the OS file cache holds them for every command alike."""
    subprocess.run([str(venv.python), "-c", PRIME_CODE], cwd=cwd, capture_output=True, timeout=600)


# ----- report -------------------------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summarize(runs: list[Run], scenario: str, baseline_file_s: float | None) -> list[dict]:
    """One row per command of a scenario: medians over its rounds, the paired ratio to transformers, the target."""
    by_key: dict[str, list[Run]] = {}
    for r in runs:
        by_key.setdefault(r.step.command.key, []).append(r)
    hf = {r.step.round: r.first_s for r in by_key.get("transformers", []) if r.ok}
    rows = []
    for key, rs in by_key.items():
        ok = [r for r in rs if r.ok]
        first = [r.first_s for r in ok]
        exits = [r.exit_s for r in ok if r.exit_s is not None]
        ratios = [r.first_s / hf[r.step.round] for r in ok if hf.get(r.step.round)]
        steps = list(dict.fromkeys(r.fields["step"] for r in ok if "step" in r.fields))  # every round's, in order
        row = dict(key=key, label=rs[0].step.command.label, n=len(rs), ok=len(ok),
                   status="ok" if ok else rs[-1].status, first_s=_median(first), exit_s=_median(exits),
                   ratio=_median(ratios), step="/".join(steps) or None,
                   compile_s=_median([float(r.fields["compile_s"]) for r in ok if "compile_s" in r.fields]),
                   first_all=first, notes=[])
        if len(ok) > 1:
            row["notes"].append(f"{len(ok)} runs, first answer {min(first):.2f}-{max(first):.2f} s")
        if len(ok) < len(rs):
            row["notes"].append(f"{len(rs) - len(ok)} of {len(rs)} runs failed: {[r.status for r in rs if not r.ok]}")
        if ok:
            last = ok[-1]
            row["notes"] += last.notes
            if key in ("generate", "transformers", "serve"):
                row["notes"].append(f"answer {last.stdout.strip()[:40]!r}")
            if key == "prompts-file":
                lines = [ln for ln in last.stdout.splitlines() if ln.strip()]
                row["notes"].append(f"{len(lines)} lines on stdout")
            if "ttfb_s" in last.fields:
                row["notes"].append(f"ttfb_s={last.fields['ttfb_s']}")
            loads = [float(r.fields["step_load_s"]) for r in ok if r.fields.get("step") == "loaded"
                     and "step_load_s" in r.fields]
            if loads:  # the compiled step read from the compile cache: its own target
                worst = max(loads)
                row["notes"].append(f"step_load_s={worst:.2f} (max; < {STEP_LOAD_TARGET_S:.0f} s: "
                                    f"{'met' if worst < STEP_LOAD_TARGET_S else 'missed'})")
            if key == "serve" and "setup_s" in last.fields:
                row["notes"].append(f"setup_s={last.fields['setup_s']}")
        row["target"] = target(row, scenario, baseline_file_s)
        rows.append(row)
    return rows


def target(row: dict, scenario: str, baseline_file_s: float | None) -> str:
    """The issue's target for this row in this scenario, with met / missed (or "-")."""
    key = row["key"]
    if key == "generate" and scenario in GENERATE_TARGET:
        t = GENERATE_TARGET[scenario]
        if row["ratio"] is None:
            return f"<= {t:.1f}x transformers: n/a"
        return f"<= {t:.1f}x transformers: {'met' if row['ratio'] <= t else 'missed'}"
    if key == "help":
        if row["exit_s"] is None:
            return f"< {HELP_TARGET_S} s: n/a"
        return f"< {HELP_TARGET_S} s: {'met' if row['exit_s'] < HELP_TARGET_S else 'missed'}"
    if key == "prompts-file" and scenario == "warm":
        if baseline_file_s is None:
            return "<= previous warm figure: n/a (no --baseline-file-s)"
        if row["exit_s"] is None:
            return f"<= {baseline_file_s:.2f} s: n/a"
        return f"<= {baseline_file_s:.2f} s (previous): {'met' if row['exit_s'] <= baseline_file_s else 'missed'}"
    return "-"


def table(rows: list[dict]) -> list[str]:
    out = ["| command | first answer s | exit s | first answer / transformers' | step | compile_s | target | notes |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ok"] == 0:
            out.append(f"| {r['label']} | {r['status']} | - | - | - | - | {r['target']} | |")
            continue
        ratio = "1.00x (reference)" if r["key"] == "transformers" else (
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}x")
        out.append(f"| {r['label']} | {_fmt(r['first_s'])} | {_fmt(r['exit_s'])} | {ratio} | {r['step'] or '-'} | "
                   f"{_fmt(r['compile_s'], 1)} | {r['target']} | {'; '.join(r['notes'])} |")
    return out


def failures(runs: list[Run]) -> list[str]:
    out = []
    for r in runs:
        if not r.ok:
            tail = "\n".join(r.stderr.strip().splitlines()[-15:])
            where = "untimed warm-up" if not r.step.timed else f"{r.step.scenario} round {r.step.round}"
            out += [f"- `{r.step.command.key}`, {where}: {r.status}", "", "```", tail, "```", ""]
    return out


def report(args: argparse.Namespace, argv: list[str], runs: list[Run], info: dict) -> str:
    from . import environment

    omp = os.environ.get("OMP_NUM_THREADS", "")
    lines = [f"# Start-up cost: demo model, CPU ({environment.today()})", "",
             f"`{'OMP_NUM_THREADS=' + omp + ' ' if omp else ''}python -m bench.startup {shlex.join(argv)}`", "",
             f"- device: {environment.device_name('cpu')}; load average (1/5/15 min) at the start: "
             f"{info['load_start']}, at the end: {environment.load_average()}",
             f"- versions (this venv, {sys.prefix}): {environment.versions()}",
             f"- threads: OMP_NUM_THREADS={omp or 'unset'} (each command's own default when unset)",
             "- method: each command a subprocess (cwd a scratch directory, PYTHONPATH unset), wall time from just "
             "before its start to the first non-blank bytes on its stdout (first answer) and to its exit; "
             "`dgemma serve`: to the response of its first POST /v1/completions (max_tokens 16), sent as soon as "
             "GET /health answers. transformers: `python -c` that imports torch and transformers, loads "
             "DiffusionGemmaForBlockDiffusion and the tokenizer, generates eagerly (checkpoint config, seed 0) and "
             "prints the answer. Every command has its own DGEMMA_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR (empty: "
             "both fresh; warm: the same again; new venv: the same DGEMMA_CACHE_DIR, a fresh Inductor directory). "
             "One untimed `python -c \"import torch, transformers, dgemma_compile\"` of its venv before each scenario "
             "(the OS file cache is never dropped).",
             "- ratio: first answer / transformers' first answer of the same round (median over rounds); "
             "`step` and `compile_s` from dgemma's stderr stats line when it has them",
             f"- targets (the issue): `dgemma generate PROMPT` first answer <= 1.5x transformers' with empty caches, "
             f"<= 1.0x warm (same or new venv); `dgemma --help` < {HELP_TARGET_S} s; the {N_PROMPTS}-prompt file, "
             "warm, no slower end to end than the previous warm figure"
             + (f" ({args.baseline_file_s:.2f} s, --baseline-file-s)" if args.baseline_file_s is not None else
                " (none given: --baseline-file-s)")]
    lines += [f"- {n}" for n in info["notes"]]
    if info.get("warm_up"):
        lines.append("- untimed warm-up runs (caches filled for warm / new venv): " + ", ".join(info["warm_up"]))
    for scenario in SCENARIOS:
        rs = [r for r in runs if r.step.scenario == scenario]
        if not rs:
            continue
        rounds = max(r.step.round for r in rs) + 1
        lines += ["", f"## {TITLES[scenario]}" + (f" ({rounds} rounds, medians)" if rounds > 1 else ""), ""]
        lines += table(summarize(rs, scenario, args.baseline_file_s))
    bad = failures(info.get("warm_up_runs", []) + runs)
    if bad:
        lines += ["", "## Failures (stderr tails)", ""] + bad
    return "\n".join(lines) + "\n"


# ----- main ---------------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of: " + ", ".join(SCENARIOS))
    p.add_argument("--repeats", type=int, default=3, help="rounds of the warm scenario (medians reported)")
    p.add_argument("--skip-new-venv", action="store_true",
                   help="make no second venv (the new-venv scenario then runs only with an existing --new-venv)")
    p.add_argument("--new-venv", type=Path, default=None, metavar="DIR",
                   help="the second venv: reused when DIR/bin/dgemma exists, else created there (default: a new "
                        "temp directory)")
    p.add_argument("--skip-serve", action="store_true", help="no `dgemma serve` row")
    p.add_argument("--baseline-file-s", type=float, default=None, metavar="S",
                   help="the previous warm end-to-end seconds of the prompts-file run (its target)")
    p.add_argument("--timeout-s", type=float, default=900, help="per command run")
    p.add_argument("--venv-timeout-s", type=float, default=1200, help="per pip / venv command")
    p.add_argument("--out", type=Path, default=None, help="results file (default bench/results/startup_cpu_<date>.md)")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--keep", action="store_true", help="keep the temp directory (caches, scratch, a venv made here)")
    p.add_argument("--note", default="", help="free text printed with the results (e.g. machine contention)")
    p.add_argument("--dry-run", action="store_true", help="print the commands with their cache directories; run "
                   "nothing")
    return p


def _show(step: Step, root: Path) -> str:
    env = f"DGEMMA_CACHE_DIR={step.dgemma_cache} TORCHINDUCTOR_CACHE_DIR={step.inductor_cache}"
    argv = [("<transformers code>" if a == HF_CODE else a) for a in step.command.argv]
    text = f"[{step.scenario}{'' if step.timed else ', untimed'} r{step.round}] {env} {shlex.join(argv)}"
    return text.replace(str(root), "$ROOT")


def background_compiles(root: Path) -> list[int]:
    """Pids of `dgemma_compile.compile.background` processes whose `DGEMMA_CACHE_DIR` lies under `root` (the ones
    this run started: a prompts file or a server compiles in a background process that outlives its command)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"dgemma_compile.compile.background" not in (proc / "cmdline").read_bytes():
                continue
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"DGEMMA_CACHE_DIR", b"").decode(errors="replace").startswith(str(root)):
            pids.append(int(proc.name))
    return pids


def wait_for_background(root: Path, timeout_s: float) -> tuple[float, int]:
    """Wait until the background compiles under `root` end (so that the next scenario finds the cache they fill, and
    they do not share its cores); returns (seconds waited, how many still run at `timeout_s`)."""
    start = time.perf_counter()
    while (left := background_compiles(root)) and time.perf_counter() - start < timeout_s:
        time.sleep(1.0)
    return time.perf_counter() - start, len(left)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        parser().error(f"--scenarios: unknown {unknown} (choose from {', '.join(SCENARIOS)})")
    if args.repeats < 1:
        parser().error("--repeats: must be at least 1")
    notes = [args.note] if args.note else []
    this = Venv("this venv", Path(sys.prefix))
    if not this.dgemma.exists():
        parser().error(f"{this.dgemma} does not exist: run from a venv where dgemma-compile is installed")

    root = Path(tempfile.gettempdir()) / "dgemma-startup-DRYRUN" if args.dry_run else \
        Path(tempfile.mkdtemp(prefix="dgemma-startup-"))
    layout = Layout(root)
    other_root = args.new_venv.resolve() if args.new_venv is not None else layout.venv
    reuse = (other_root / "bin" / "dgemma").exists()
    other = None
    if "new-venv" in scenarios:
        if reuse or not args.skip_new_venv:
            other = Venv("new venv", other_root)
        else:
            notes.append("new venv: skipped (--skip-new-venv and no existing --new-venv)")
    port = DEFAULT_PORT if args.dry_run else serve_port()
    steps = plan(scenarios, layout, this, other, args.repeats, port, serve=not args.skip_serve)

    if args.dry_run:
        print(f"# ROOT = a fresh temp directory; cwd $ROOT/work; prompts: {N_PROMPTS} held-out demo prompts in "
              f"{layout.prompts_file}".replace(str(root), "$ROOT"))
        if other is not None and not reuse:
            for c in venv_commands(other.root):
                print(f"[new-venv setup] {shlex.join(c)}".replace(str(root), "$ROOT"))
        for s in steps:
            print(_show(s, root))
        return 0

    info = dict(load_start=None, notes=notes, warm_up=[], warm_up_runs=[])
    from . import environment

    info["load_start"] = environment.load_average()
    runs: list[Run] = []
    try:
        write_prompts_file(layout.prompts_file)
        if port != DEFAULT_PORT:
            notes.append(f"port {DEFAULT_PORT} was taken: `dgemma serve --port {port}`")
        if other is not None:
            if reuse:
                notes.append(f"new venv: reused {other.root}")
            else:
                print(f"startup: creating {other.root} (pip, ~1-2 min)...", file=sys.stderr, flush=True)
                try:
                    seconds = make_venv(other.root, root / "venv-install.log", args.venv_timeout_s)
                    notes.append(f"new venv: made at {other.root} in {seconds:.0f} s (python -m venv; pip install "
                                 f"{TORCH_PIN}; pip install REPO 'REPO[serve]')")
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    notes.append(f"new venv: could not be made ({e}); scenario skipped")
                    steps = [s for s in steps if s.scenario != "new-venv"]
                    other = None
            if other is not None:
                notes.append(f"new venv versions: {venv_versions(other)}")
        primed = None
        for step in steps:
            if step.scenario != primed and primed is not None:  # the previous scenario's background compiles
                waited, left = wait_for_background(root, args.timeout_s)
                notes.append(f"before {step.scenario}: waited {waited:.0f} s for the background compiles started "
                             f"by {primed}" + (f" ({left} still running at the timeout)" if left else ""))
            if step.scenario != primed:  # once per scenario (the warm-up's runs count as one)
                prime(other if step.scenario == "new-venv" else this, layout.work)
                primed = step.scenario
            run = execute(step, layout.work, args.timeout_s)
            if step.timed:
                runs.append(run)
            else:
                info["warm_up_runs"].append(run)
                info["warm_up"].append(f"{step.command.key} " + (_fmt(run.first_s) + " s" if run.ok else run.status)
                                       + (f" (compile_s={run.fields['compile_s']})" if "compile_s" in run.fields
                                          else ""))
    finally:
        if args.keep:
            print(f"startup: kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    text = report(args, argv, runs, info)
    print(text)
    if not args.no_write:
        out = args.out if args.out is not None else RESULTS / f"startup_cpu_{environment.today()}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"startup: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The docs check (docs/testing.md, "The docs check"): every repository path README.md, docs/*.md and
bench/README.md name exists (fast tier), and every command of their ```bash blocks runs from the repository root (a
copy of its tracked files) within a time cap (slow tier), or is listed in EXCEPTIONS with its reason."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
EXTS = (".py", ".md", ".json", ".toml", ".sh", ".txt", ".jinja", ".csv")
# names a doc mentions that are not files of this repository
EXTERNAL = {
    "config.json": "a checkpoint's file", "generation_config.json": "a checkpoint's file",
    "model.safetensors.index.json": "a checkpoint's file", "tokenizer_config.json": "a checkpoint's file",
    "chat_template.jinja": "a checkpoint's file", "processor_config.json": "a checkpoint's file",
    "preprocessor_config.json": "a checkpoint's file",
    "modeling_diffusion_gemma.py": "transformers' source", "generation_diffusion_gemma.py": "transformers' source",
    "configuration_diffusion_gemma.py": "transformers' source", "/openapi.json": "a server route",
}
TIME_CAP_S = 300
# (command prefix, why it is not run)
EXCEPTIONS = [
    ("python3 -m venv", "an install into a fresh virtual environment (.ci/run runs the test command)"),
    ("pip install", "an install"),
    ("dgemma serve --model", "a server that runs until interrupted (tests/runtime/test_serve.py starts one on loopback)"),
    ("curl ", "needs a running server"),
    ("bash bench/h200.sh", "needs a GPU"),
    ("bash bench/gpu_prepare.sh", "downloads wheels from PyPI"),
    ("bash bench/gpu_versions_check.sh", "a venv of ~4.5 GB from PyPI, then ~12 min of tests and benchmarks"),
    ("bash bench/gpu_rehearse.sh", "the GPU run rehearsed on a CPU (~20 min)"),
    ("BENCH_QUANT=", "needs a GPU"),
    ("BENCH_MODEL=full-tiny", "a long benchmark (about 10 min)"),
    ("OMP_NUM_THREADS=1 python -m bench --model demo --workloads", "a long benchmark"),
    ("OMP_NUM_THREADS=1 python -m bench --model scaled", "a long benchmark"),
    ("OMP_NUM_THREADS=1 python -m bench.passes", "a long benchmark"),
    ("OMP_NUM_THREADS=1 python -m bench.idle_vocabulary", "a benchmark with 4 compiles (~5 min on 2 cores)"),
    ("OMP_NUM_THREADS=1 python -m bench.overhead", "a long benchmark"),
    ("OMP_NUM_THREADS=1 python -m bench.mixed_step", "a long benchmark"),
    ("OMP_NUM_THREADS=1 python -m bench.serve", "a long benchmark that starts servers"),
    ("OMP_NUM_THREADS=1 python -m bench.images", "a benchmark with a compile (about 2 min on 2 cores)"),
    ("OMP_NUM_THREADS=1 python -m bench.parallel ", "a long benchmark (10 gloo ranks' runs, ~15 min on 2 cores)"),
    ("OMP_NUM_THREADS=1 python -m bench.parallelism --n 200", "a 3-minute sweep (its smoke run is checked)"),
    ("OMP_NUM_THREADS=1 python -m bench.pinned", "a benchmark (2,000 eager generations, ~2 min on 2 cores)"),
    ("git worktree add", "checks out old commits beside the repository (the before/after run's set-up)"),
    ("OMP_NUM_THREADS=1 python -m bench.before_after", "a long benchmark (~40 min: three trees' workers; its --help "
                                                       "is checked)"),
]


def _named_paths(text: str) -> list[str]:
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)
    out = []
    for s in spans:
        s = s.strip().split("#")[0]
        if not re.fullmatch(r"[\w./*{}<>-]+", s) or s.startswith(("http", "/v1", "-", ".")) or ".." == s:
            continue
        if "/" in s or s.endswith(EXTS):
            out.append(s)
    return out


def _exists(doc: Path, name: str) -> bool:
    if name in EXTERNAL or "{" in name or "<" in name:
        return True
    for base in (ROOT, doc.parent, ROOT / "dgemma_compile"):  # `compile/units.py`: inside the package
        if "*" in name:
            if list(base.glob(name)):
                return True
        elif (base / name).exists():
            return True
    if "/" not in name:  # a bare module or file name (`masks.py`): somewhere in the package, runtime, bench or tools
        return any(p.name == name for d in ("dgemma_compile", "runtime", "bench", "tools", "tests")
                   for p in (ROOT / d).rglob(name))
    if name.startswith("/"):  # a route
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_exist(doc):
    missing = [n for n in _named_paths(doc.read_text()) if not _exists(doc, n)]
    assert not missing, missing


def _bash_commands() -> list[tuple[str, str]]:
    cmds = []
    for doc in DOCS:
        for block in re.findall(r"^```bash\n(.*?)^```", doc.read_text(), flags=re.S | re.M):
            for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
                cmd = cmd.strip()
                if cmd and not cmd.startswith("#"):
                    cmds.append((doc.relative_to(ROOT).as_posix(), cmd))
    return cmds


COMMANDS = _bash_commands()


def _exception(cmd: str) -> str | None:
    return next((why for prefix, why in EXCEPTIONS if cmd.startswith(prefix)), None)


def test_docs_have_runnable_commands_and_no_stale_exceptions():
    assert any(_exception(c) is None for _, c in COMMANDS)
    unused = [p for p, _ in EXCEPTIONS if not any(c.startswith(p) for _, c in COMMANDS)]
    assert not unused, unused


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files (`git ls-files`, ~20 MB) where the docs' commands run: what they write
    (a benchmark's results file under bench/results, named by today's date like a committed one) stays out of the
    checkout. The installed package is the checkout's either way."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    copy = tmp_path_factory.mktemp("docs-tree")
    for name in filter(None, files.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("doc,cmd", [c for c in COMMANDS if _exception(c[1]) is None],
                         ids=[c[1][:60] for c in COMMANDS if _exception(c[1]) is None])
def test_runnable_command_runs(doc, cmd, tree):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    r = subprocess.run(["bash", "-c", "set -o pipefail; " + cmd], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=TIME_CAP_S)
    assert r.returncode == 0, f"{doc}: {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"

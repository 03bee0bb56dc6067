"""Compiling a step in a background process while the eager step answers.

`BackgroundCompile(spec)` starts `python -m dgemma_compile.compile.background SPEC` (SPEC: a `CompileSpec` as JSON),
which loads the same checkpoint the same way, builds a generator with the same `CompileOptions`, thread count and
structural generation config, and compiles the batch sizes asked for (`CompiledGenerator.warmup`): each compile saves
its step to the compile cache (`artifacts.ArtifactStore`), under the key the foreground computes for its own
bucket. The foreground polls (`poll()`, between iterations: a non-blocking `Popen.poll`) and, once the process has
exited 0, loads those artifacts and switches its bucket's steps to them (`CompiledGenerator.switch_to_compiled`).

Why a process and not a thread (measured on 2 cores, the demo model): tracing and Inductor's code generation are
Python and hold the GIL for most of a compile, so a compile thread slowed the eager step running beside it, while a
process takes the other core; the artifact it leaves is what a warm start loads anyway, so the switch exercises the
warm path. The cost: the process loads the model again (the demo's: 0.1 s; a released checkpoint's: its load time).

A job that ends before its background compile does leaves the process running in its own session: it finishes
filling the compile cache, so the next run loads the step (the job started the compile because it judged the step
worth compiling; stopping it would make every such run eager). Its log is kept under the cache's `logs/` only when it
fails. Processes compiling the same step take turns: each holds the step key's lock (`locks/KEY.lock`, `fcntl.flock`)
while it compiles, and one that gets the lock after another finished loads the entry instead of compiling again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("dgemma_compile")


@dataclass(frozen=True)
class CompileSpec:
    """What a background process needs to compile the foreground's steps bit for bit: the checkpoint directory, its
    dtype name (None: the checkpoint's) and quantization scheme (None: none, or the checkpoint's own), the
    `CompileOptions` fields, the structural generation config (`stop_early`, `stability_threshold`, `eos_token_ids`),
    the batch sizes to compile, the intra-op thread count (Inductor's CPU kernels are generated for it) and the cache
    directory (`DGEMMA_CACHE_DIR` of the child)."""

    model: str
    dtype: str | None
    quant: str | None
    options: dict
    config: dict
    sizes: list
    threads: int
    cache_dir: str
    paging: dict = field(default_factory=dict)


def options_fields(options) -> dict:
    """`CompileOptions` as JSON-able fields (tuples become lists; `from_fields` turns them back)."""
    return json.loads(json.dumps(asdict(options)))


def from_fields(fields: dict):
    from .options import CompileOptions

    out = dict(fields)
    for name in ("batch_buckets", "disabled_passes"):
        if out.get(name) is not None:
            out[name] = tuple(out[name])
    return CompileOptions(**out)


class BackgroundCompile:
    """One background compile process (see the module docstring). `state`: "running", "done" or "failed";
    `error`: the tail of its log when it failed; `seconds`: from start to exit."""

    def __init__(self, spec: CompileSpec):
        self.spec = spec
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self.state = "running"
        self.error: str | None = None
        try:
            logs = Path(spec.cache_dir) / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(dir=logs, prefix="background-", suffix=".log")
        except OSError as e:  # a cache that cannot hold a log cannot hold the step either: never started
            self.proc, self.state, self.seconds = None, "failed", 0.0
            self.error = f"cannot start it in {spec.cache_dir}: {type(e).__name__}: {e}"
            return
        self.log_path = Path(path)
        env = {**os.environ, "DGEMMA_CACHE_DIR": spec.cache_dir, "OMP_NUM_THREADS": str(spec.threads),
               "DGEMMA_BACKGROUND_LOG": path}
        with os.fdopen(fd, "wb") as out:  # its own session: it outlives a job that ends first (module docstring)
            self.proc = subprocess.Popen([sys.executable, "-m", "dgemma_compile.compile.background",
                                          json.dumps(asdict(spec))], stdout=out, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def poll(self) -> str:
        """The process's state now, without waiting."""
        if self.state == "running" and self.proc is not None and self.proc.poll() is not None:
            self.seconds = time.perf_counter() - self.started
            if self.proc.returncode == 0:
                self.state = "done"
            else:
                self.state = "failed"
                try:
                    tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
                except OSError:
                    tail = []
                self.error = f"exit {self.proc.returncode}: " + " | ".join(tail) + f" (log: {self.log_path})"
        return self.state

    def stop(self) -> None:
        """Stop a running process and wait for it (tests; a job that ends first leaves it running)."""
        if self.state == "running" and self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.state = "stopped"
            self.log_path.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    """The background process: compile `CompileSpec` JSON `argv[0]`'s sizes into the compile cache."""
    spec = CompileSpec(**json.loads(argv[0]))
    import torch

    from ..model.loader import load
    from .generator import build

    torch.set_num_threads(spec.threads)
    model = load(spec.model, dtype=getattr(torch, spec.dtype) if spec.dtype else None)
    if spec.quant is not None and model.checkpoint.quant_scheme is None:
        from ..quant import quantize

        quantize(model, spec.quant)
    config = model.generation_config.replace(**spec.config)
    gen = build(model, from_fields(spec.options))
    if gen.units.store is None:
        print("background compile: the compile cache is off", file=sys.stderr)
        return 2
    store = gen.units.store
    row_table = gen.row_table(config, **spec.paging)
    keys = []
    for size in spec.sizes:
        unit = row_table.view(row_table.size_for(gen.bucket_for(size))).step
        keys.append(unit.key)
        with key_lock(store.root, unit.key):  # another process compiling it: wait, then load its entry
            gen.warmup(size, config, **spec.paging)
    print(f"background compile: sizes {spec.sizes} saved={store.saves} loaded={store.loads}", file=sys.stderr)
    if not all(key is not None and store.has(key) for key in keys):
        return 3
    if os.environ.get("DGEMMA_BACKGROUND_LOG"):  # success: no log kept
        Path(os.environ["DGEMMA_BACKGROUND_LOG"]).unlink(missing_ok=True)
    return 0


@contextlib.contextmanager
def key_lock(root: Path, key: str | None):
    """Hold `root/locks/KEY.lock` exclusively for the block (blocking until another holder releases it)."""
    if key is None:
        yield
        return
    path = Path(root) / "locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))

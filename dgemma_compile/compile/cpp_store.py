"""A C++ build store that survives a new virtual environment: every g++ build Inductor runs (kernels, the C++
wrapper, the ISA probes) is kept under a key that names what the output depends on and nothing else.

Why: Inductor keys its CPU C++ builds (`CppCodeCache.load_async`) by the source together with the compiler's whole
command line, whose `-I`/`-L` paths name the virtual environment's torch; so a venv at another path, a new clone's
`.venv` or a reinstall misses every build even when its graph cache hits, and pays the cold g++ time again (90 % of a
first compile of the demo's step on 2 cores). The portable caches (`torch.compiler.save_cache_artifacts`,
`standalone_compile`) carry the C++ source, not the `.so`. DeepGEMM (PR 388/398) and vLLM (PR 47573) fixed the same
kind of path-keyed cache.

How: inside `building_from(store)` (entered around our own compiles, in-process and AOTInductor's; nothing at
import time; a step loaded from the compile cache is a package with its library built in, and builds nothing),
`torch._inductor.cpp_builder.CppBuilder.build` first looks the build up here by its portable key; a hit copies the
stored output to the path Inductor expects (so Inductor's own checks then find it), a miss runs g++ and stores the
output. The portable key hashes: this store's format version, the compiler's identity (`g++ -dumpfullversion
-dumpmachine`), the CPU (`-march=native` builds for the host: its model name and flags), torch's version, the
command line with the paths that differ between installs replaced by placeholders (torch's package directory,
Python's prefixes, the files the build reads and writes, whose names are Inductor's venv-dependent keys, and its
output directory), and the content of every file it reads (sources, a precompiled header it `-include`s). A changed
source, flag, compiler, CPU or torch is a miss; the venv's path is not.

Entries are written to a temporary name and renamed into place (two processes filling one entry leave one whole
entry), with the output's sha256 beside it; an entry whose bytes do not match is logged, removed and rebuilt, never
loaded. `CppStore.builds` / `hits` count what happened (tests and the CLI's stats read them).

The same context records Inductor's SIMD ISA probes (`VecISA.check_build`: a g++ build and a `dlopen` in a child
process per candidate ISA: most of a warm in-process compile's set-up) by compiler, CPU, torch and flags
(`CppStore.probe`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("dgemma_compile")

FORMAT = "dgemma-cpp-store/1"


@functools.cache
def compiler_identity(compiler: str) -> str:
    """`compiler -dumpfullversion -dumpmachine` (one subprocess per compiler and process), or the error's text."""
    try:
        out = subprocess.run([compiler, "-dumpfullversion", "-dumpmachine"], capture_output=True, text=True,
                             timeout=30, check=False)
        return f"{compiler}: {out.stdout.strip()} {out.returncode}"
    except OSError as e:
        return f"{compiler}: {type(e).__name__}"


@functools.cache
def cpu_identity() -> str:
    """The host CPU as `-march=native` sees it: /proc/cpuinfo's model name and flags of the first processor (Linux),
    else `platform.processor()` and the machine type."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"
    first = text.split("\n\n", 1)[0]
    keep = [line.split(":", 1)[1].strip() for line in first.splitlines()
            if line.split(":", 1)[0].strip() in ("vendor_id", "model name", "flags", "Features", "CPU part")]
    return " | ".join(keep)


def install_paths() -> list[tuple[str, str]]:
    """(path, placeholder) pairs of the directories that differ between installs of the same versions, longest
    first: torch's package directory and Python's prefixes."""
    import torch

    pairs = {os.path.dirname(os.path.abspath(torch.__file__)): "<torch>", sys.prefix: "<prefix>",
             sys.exec_prefix: "<exec_prefix>", sys.base_prefix: "<base_prefix>",
             sys.base_exec_prefix: "<base_exec_prefix>"}
    return sorted(pairs.items(), key=lambda kv: -len(kv[0]))


@dataclass
class CppStore:
    """Built C++ outputs by portable key under `root` (see the module docstring). `builds`: outputs g++ made (stored);
    `hits`: outputs served from the store; `corrupt`: entries found damaged (removed, then rebuilt)."""

    root: Path
    builds: int = 0
    hits: int = 0
    corrupt: int = 0
    probes_recorded: int = 0  # ISA probes answered from the store (`probe`)
    misses: list = field(default_factory=list)  # the first few missed builds' targets, for logs

    def key(self, builder) -> str:
        """The portable key of one `CppBuilder` (see the module docstring)."""
        import torch

        command = builder.get_command_line()
        target = builder.get_target_file_path()
        # the files the command reads (sources, a forced `-include` of a precompiled header): their names are
        # Inductor's own keys, which hash the venv's paths, so they are named by position and hashed by content
        sources = list(dict.fromkeys(t for t in re.split(r"\s+", command) if t and t != target and os.path.isfile(t)))
        replace = [(target, "<target>")] + [(s, f"<file{i}>") for i, s in enumerate(sources)]
        replace += ([(builder._output_dir, "<out>")] if builder._output_dir else []) + install_paths()
        for path, mark in sorted(replace, key=lambda kv: -len(kv[0])):
            if path and path != os.sep:
                command = command.replace(path, mark)
        h = hashlib.sha256()
        for part in (FORMAT, compiler_identity(builder._compiler), cpu_identity(), torch.__version__,
                     torch.version.git_version or "", command):
            h.update(part.encode() + b"\0")
        for s in sources:
            h.update(hashlib.sha256(Path(s).read_bytes()).digest())
        return h.hexdigest()

    def _entry(self, key: str) -> tuple[Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}.bin", d / f"{key}.sha256"

    def fetch(self, key: str, target: str) -> bool:
        """Copy entry `key` to `target` if it is whole (its sha256 matches); a damaged entry is removed."""
        blob, digest = self._entry(key)
        try:
            data, want = blob.read_bytes(), digest.read_text().strip()
        except OSError:
            return False
        if hashlib.sha256(data).hexdigest() != want:
            self.corrupt += 1
            log.warning("C++ store: entry %s is damaged (sha256 mismatch); removing it and building again", key[:16])
            for p in (blob, digest):
                with contextlib.suppress(OSError):
                    p.unlink()
            return False
        _write_atomic(Path(target), data)
        return True

    def put(self, key: str, target: str) -> None:
        """Store the built `target` as entry `key` (the bytes first, then their sha256: a reader never sees a
        digest without its bytes)."""
        data = Path(target).read_bytes()
        blob, digest = self._entry(key)
        _write_atomic(blob, data)
        _write_atomic(digest, hashlib.sha256(data).hexdigest().encode())

    def probe(self, isa, code: str, original) -> bool:
        """`VecISA.check_build` through the store: Inductor probes each candidate SIMD ISA once per process by
        building `code` with the ISA's flags and `dlopen`ing the result in a child process (six probes, ~0.3-1.5 s
        each on 2 cores: most of a warm in-process compile's set-up). The answer depends on the compiler, the CPU, torch (which
        writes `code`) and the flags, which are the key; a recorded answer is returned without building or
        probing."""
        import torch
        from torch._inductor.cpp_builder import get_cpp_compiler

        h = hashlib.sha256()
        for part in (FORMAT, "isa-probe", compiler_identity(get_cpp_compiler()), cpu_identity(), torch.__version__,
                     torch.version.git_version or "", type(isa).__name__, isa.build_arch_flags(), code):
            h.update(part.encode() + b"\0")
        record = self.root / "isa" / h.hexdigest()
        try:
            answer = record.read_text()
        except OSError:
            answer = ""
        if answer in ("ok", "refused"):
            self.probes_recorded += 1
            return answer == "ok"
        ok = bool(original(isa, code))
        with contextlib.suppress(OSError):  # an unwritable store: the probe's answer still stands
            _write_atomic(record, b"ok" if ok else b"refused")
        return ok

    def build(self, builder, original) -> None:
        """`CppBuilder.build` through the store."""
        target = builder.get_target_file_path()
        try:
            key = self.key(builder)
        except OSError as e:  # a source vanished: build as Inductor would, unstored
            log.warning("C++ store: no key for %s (%s); building unstored", target, e)
            original(builder)
            return
        if self.fetch(key, target):
            self.hits += 1
            return
        if len(self.misses) < 8:
            self.misses.append(os.path.basename(target))
        original(builder)
        self.builds += 1
        try:
            self.put(key, target)
        except OSError as e:  # a full disk or a read-only store: the build itself succeeded
            log.warning("C++ store: could not store %s (%s)", os.path.basename(target), e)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_active: list[CppStore] = []


@contextlib.contextmanager
def building_from(store: CppStore | None, device=None):
    """Route Inductor's C++ builds through `store` for the duration of the block (None: no change). For a CPU
    `device`, also keeps Inductor's kernel builds in this process (`compile_threads=1`: with the C++ wrapper, the CPU
    default, a graph is one C++ file anyway), so that every build passes through the store, and builds without
    Inductor's precompiled headers (`cpp_cache_precompile_headers=False`: they live in a fixed directory under names
    that hash the venv's paths, outside the store, so a new venv would rebuild one on every load); other devices keep
    their parallel (Triton) compiles, whose binaries the step artifact carries itself. Nests; the patch is removed
    when the outermost block exits."""
    if store is None:
        yield
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import CppBuilder

    outermost = not _active
    if outermost:
        from torch._inductor.cpu_vec_isa import VecISA

        original, original_probe = CppBuilder.build, VecISA.check_build

        def build(self) -> None:
            _active[-1].build(self, original)

        def check_build(self, code: str) -> bool:
            return _active[-1].probe(self, code, original_probe)

        CppBuilder.build, VecISA.check_build = build, check_build
    _active.append(store)
    cpu = device is None or getattr(device, "type", device) == "cpu"
    try:
        with inductor_config.patch(compile_threads=1, cpp_cache_precompile_headers=False) if cpu else \
                contextlib.nullcontext():
            yield
    finally:
        _active.pop()
        if outermost:
            CppBuilder.build, VecISA.check_build = original, original_probe


def clear(root: Path) -> None:
    """Remove every entry under `root`."""
    shutil.rmtree(root, ignore_errors=True)

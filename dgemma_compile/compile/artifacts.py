"""Compiled steps kept on disk, so that a later process loads a batch size's step instead of tracing and compiling it.

One artifact per compile unit: the unit's one graph compiled by AOTInductor into a package (`aoti.py`: a shared
library with a C++ wrapper, made from Inductor's kernels for the graph under the unit's config and decompositions),
the names of the tensors it takes, in order (the model's parameters and buffers by name, the bucket's buffers by
position), and a readable record of its key. Loading one is an unzip and a `dlopen` through libtorch's AOTInductor runner: no
Dynamo trace, no AOTAutograd, no Inductor codegen, no g++, and no import of Dynamo or Inductor (~0.01 s for the
demo's step, against 0.9-2.5 s for Inductor's own `CompiledArtifact`, whose unpickling imports the compiler). Where
AOTInductor cannot package a graph, the entry holds that `CompiledArtifact` instead (`ARTIFACTS`: its "kind").

Where: `cache_root()`: `$DGEMMA_CACHE_DIR`, else `$XDG_CACHE_HOME/dgemma_compile`, else `~/.cache/dgemma_compile`;
`steps/` holds the artifacts, `cpp/` the C++ builds of in-process compiles (`cpp_store.py`) and `tmp/` packages
being compiled. `DGEMMA_CACHE=off` turns the cache off (every process compiles,
as torch.compile alone would); `dgemma cache info | clear` shows and empties it.

The key (`step_key`) is what the artifact depends on, and nothing else: the format version; torch's version and
Python's; the device (and for a CPU, its ISA as the compiler sees it); the intra-op thread count (Inductor's CPU
kernels are generated for it); every `CompileOptions` field that reaches the graph; the Dynamo / Inductor /
AOTAutograd settings a caller changed from their defaults, and the `TORCHINDUCTOR_*` / `TORCHDYNAMO_*` environment
variables (what torch's own caches hash too); the model's structure (per
parameter and buffer its name, dtype, device, shape and stride; the plain constants of its modules; not its values,
which are inputs); the unit's name and structural config and its buffers' dtypes, shapes and strides; and, per
folder (`source_room`), the sha256 of the source files of the `dgemma_compile` package that a step can trace (our
passes and decompositions included; not `cli/` and `demo/`: `UNTRACED`). A changed source or option is therefore a miss, never a stale load
(tests/compile/test_artifacts.py changes each and checks).

A miss is logged with its reason (no entry, or the differing parts of the nearest entry of the same unit, the
folders whose sources changed named); an entry
is written under a temporary name and renamed into place (two processes filling one entry keep one whole entry); an
entry whose files do not match their recorded sha256, whose inputs do not resolve to tensors of the recorded dtypes
and shapes, or that fails to load, is logged, removed and rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from . import aoti
from .cpp_store import CppStore, cpu_identity

log = logging.getLogger("dgemma_compile")

FORMAT = "dgemma-step-artifact/2"
"""/2: an AOTInductor package (`aoti.py`), or Inductor's own artifact where AOTInductor cannot package the graph;
/1 held only the latter."""
ARTIFACTS = {"aoti": "step.pt2", "inductor": "artifact.bin"}
"""An entry's artifact file per kind (`meta.json`'s "kind"): an AOTInductor package, or Inductor's own binary
artifact (`standalone_compile(..., aot=True)`, loaded by `CompiledArtifact.load`, which imports the compiler)."""
ARTIFACT = ARTIFACTS["aoti"]
INPUTS, META = "inputs.json", "meta.json"
NOT_IN_KEY = ("artifact_cache", "direct_calls", "skip_guards", "recompile_limit", "cuda_graphs")
"""`CompileOptions` fields that cannot change a compiled graph: whether this store is used, how a step is called
(directly, through Dynamo with or without guards, replayed as a CUDA graph: decided after the graph exists) and how
many recompiles Dynamo allows."""
CONFIG_MODULES = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "AOT_INDUCTOR_", "AOTINDUCTOR_", "AOTI_")
"""Environment variables whose values the compiler reads (Inductor's AOT settings among them, e.g.
AOT_INDUCTOR_DEBUG_INTERMEDIATE_VALUE_PRINTER: read into the config's defaults at import, so `ambient_config` cannot
see them)."""
ENV_IGNORED = ("TORCHINDUCTOR_CACHE_DIR",)  # where Inductor caches, not what it makes
CONFIG_IGNORED = {"torch._inductor.config": ("compile_threads", "cpp_cache_precompile_headers")}
"""Settings of how a graph is built, not what it builds: the number of compile workers and precompiled headers (a
build speed-up of the same source; `cpp_store.building_from` sets both, and a caller inside such a block must key
the step as one outside it does)."""


def cache_root() -> Path | None:
    """The user-level cache directory (it may not exist yet), or None when `DGEMMA_CACHE` is off (0, off, false,
    no)."""
    if os.environ.get("DGEMMA_CACHE", "").strip().lower() in ("0", "off", "false", "no"):
        return None
    if os.environ.get("DGEMMA_CACHE_DIR", "").strip():
        return Path(os.environ["DGEMMA_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "dgemma_compile"


UNTRACED = ("cli", "demo")
"""Folders of the package whose code no step traces: the command line (argument parsing, the commands, which call
`build` and `generate` like any user, the rank launcher, the process settings) and the demo's task suite. No other
module imports them (tests/compile/test_artifacts.py checks it), so an edit there cannot change a compiled graph, and is
no miss."""


def source_room(rel: Path) -> str:
    """The room a package file belongs to in the sources digest: its folder (`model`, `step`, ...), a kernel's own
    folder (`kernels/moe`, `kernels/sample`), or a top-level module's file name (`oracle.py`)."""
    if len(rel.parts) == 1:
        return rel.name
    if rel.parts[0] == "kernels" and len(rel.parts) > 2:
        return "/".join(rel.parts[:2])
    return rel.parts[0]


@functools.cache
def sources_digest(package_dir: str | None = None) -> dict[str, str]:
    """Per room (`source_room`), sha256 over its `.py` files that a step can trace (all but `UNTRACED`'s): relative
    path and bytes, sorted. Every room is in every step's key (a step may trace any of them); a miss names the rooms
    that changed."""
    root = Path(package_dir) if package_dir else Path(__file__).resolve().parent.parent
    hashes: dict = {}  # room -> its running sha256
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] in UNTRACED:
            continue
        hashes.setdefault(source_room(rel), hashlib.sha256()).update(str(rel).encode() + b"\0" + p.read_bytes() + b"\0")
    return {room: h.hexdigest() for room, h in sorted(hashes.items())}


def _plain(value):
    """A JSON-able, deterministic form of an option or config value."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def device_identity(device: torch.device) -> str:
    """What compiled code is specific to: a GPU's index (generated code names it), name and capability; a CPU's
    model name and ISA flags (`cpp_store.cpu_identity`)."""
    if device.type == "cuda":
        cap = "".join(map(str, torch.cuda.get_device_capability(device)))
        return f"{device} {torch.cuda.get_device_name(device)} sm{cap}"
    if device.type == "cpu":
        return f"cpu {cpu_identity()}"
    return device.type


def ambient_config() -> dict:
    """The compiler settings a caller changed: per config module already imported, its values that differ from the
    defaults (a module not imported yet holds only defaults; `CONFIG_IGNORED` left out), and the compiler's
    environment variables."""
    out = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED}
    for name in CONFIG_MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        # values compared with their defaults (torch's `_is_default` also counts a patch that was undone, as our own
        # `options.applied` patches are, which would make every key after a first compile differ)
        ignored = CONFIG_IGNORED.get(name, ())
        changed = {k: v for k, v in mod.get_config_copy().items()
                   if k in mod._config and k not in ignored and not _same(v, mod._config[k].default)}
        if changed:
            out[name] = _plain(changed)
    return out


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality compare by identity
        return a is b


def model_structure(model: torch.nn.Module) -> list:
    """Per parameter and buffer (name, dtype, device type, shape, stride), and the plain constants of the model's own
    modules: `units.ModelFingerprint` without data pointers."""
    from .units import ModelFingerprint

    out = []
    for e in ModelFingerprint.of(model).entries:
        if e[0] == "attribute":
            out.append([e[0], e[1], _plain(e[2])])
        else:
            kind, name, dtype, dev, shape, stride, _ = e
            out.append([kind, name, str(dtype), dev.type, list(shape), list(stride)])
    return out


def step_key_parts(*, options, model: torch.nn.Module, unit: str, structure: dict,
                   tensors: list[torch.Tensor]) -> dict:
    """The parts `step_key` hashes (see the module docstring), readable: kept in each entry's meta.json, and compared
    part by part to explain a miss."""
    return {
        "format": FORMAT,
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "python": f"{platform.python_implementation()} {sys.version_info[:3]}",
        "device": device_identity(model.device),
        "threads": torch.get_num_threads(),
        "options": {f.name: _plain(getattr(options, f.name)) for f in fields(options) if f.name not in NOT_IN_KEY},
        "compiler_config": ambient_config(),
        "model": hashlib.sha256(json.dumps(model_structure(model)).encode()).hexdigest(),
        "model_config": _plain(vars(model.config)) if hasattr(model, "config") else None,
        "unit": unit,
        "structure": _plain(structure),
        "buffers": [[str(t.dtype), list(t.shape), list(t.stride())] for t in tensors],
        "sources": dict(sources_digest()),  # a copy: the cached dict is shared by every key
    }


def step_key(parts: dict) -> str:
    """sha256 hex of `step_key_parts`'s dict."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def tensor_meta(t: torch.Tensor) -> list:
    """dtype, shape, stride and storage offset: what a compiled graph's kernels assume of an input (Inductor's
    kernels may assume the example's alignment, which its storage offset decides)."""
    return [str(t.dtype), list(t.shape), list(t.stride()), t.storage_offset()]


def input_names(graph_inputs: list, model: torch.nn.Module, tensors: list[torch.Tensor]) -> list[str] | None:
    """Each graph input's name: "param:NAME" / "buffer:NAME" for the model's tensors, "bucket:I" for the I-th of
    `tensors`; None when an input is none of them (such a graph is not saved)."""
    named = {}
    for i, t in enumerate(tensors):
        named.setdefault(id(t), f"bucket:{i}")
    for n, t in model.named_buffers():
        named.setdefault(id(t), f"buffer:{n}")
    for n, t in model.named_parameters():
        named.setdefault(id(t), f"param:{n}")
    out = [named.get(id(x)) if isinstance(x, torch.Tensor) else None for x in graph_inputs]
    return None if None in out else out


def resolve_inputs(names: list[str], meta: list, model: torch.nn.Module, tensors: list[torch.Tensor]
                   ) -> list[torch.Tensor]:
    """The tensors `names` (`input_names`) denote now, each checked against its recorded `tensor_meta`.

    Raises:
        ValueError: a name that denotes nothing, or a tensor whose dtype, shape or stride is not the recorded one."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    if len(names) != len(meta):
        raise ValueError(f"{len(names)} input names for {len(meta)} recorded inputs")
    out = []
    for n, want in zip(names, meta):
        kind, _, rest = n.partition(":")
        try:
            t = tensors[int(rest)] if kind == "bucket" else params[rest] if kind == "param" else buffers[rest]
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"input {n!r} denotes no tensor of the model or the bucket") from None
        if tensor_meta(t) != want:
            raise ValueError(f"input {n!r} is {tensor_meta(t)}, recorded {want}")
        out.append(t)
    return out


@dataclass
class Loaded:
    """A loaded artifact: its callable, its inputs (resolved) and its record (meta.json)."""

    fn: object
    inputs: list
    meta: dict


@dataclass
class ArtifactStore:
    """Compiled steps under `root/steps`, their C++ under `root/cpp` (`cpp`). Counts: `loads` (served), `saves`,
    `misses` (with reasons in `miss_reasons`), `corrupt` (entries removed)."""

    root: Path
    loads: int = 0
    saves: int = 0
    misses: int = 0
    corrupt: int = 0
    miss_reasons: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.cpp = CppStore(self.root / "cpp")

    @classmethod
    def default(cls) -> "ArtifactStore | None":
        """The store at `cache_root()`, or None when the cache is off or unusable (a path that is not a directory,
        or a directory that cannot be created or written: logged once, naming it)."""
        root = cache_root()
        if root is None:
            return None
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=root, prefix=".probe-")
            probe.close()
        except OSError as e:
            _warn_once(f"compile cache: {root} is not usable ({type(e).__name__}: {e}); steps compile in each process "
                       "(set DGEMMA_CACHE_DIR to a writable directory, or DGEMMA_CACHE=off)")
            return None
        return cls(root)

    def _dir(self, key: str) -> Path:
        return self.root / "steps" / key[:2] / key

    def has(self, key: str) -> bool:
        """Whether an entry for `key` is in place (`load` still checks it whole)."""
        return (self._dir(key) / META).is_file()

    def load(self, key: str, parts: dict, model: torch.nn.Module, tensors: list[torch.Tensor]) -> Loaded | None:
        """The artifact of `key` with its inputs resolved over `model` and `tensors` (`resolve_inputs`), or None: a
        miss (logged with its reason), or a damaged entry (logged and removed): files whose sha256 differs from the
        recorded one, inputs that do not resolve, or an artifact torch cannot load."""
        d = self._dir(key)
        if not (d / META).is_file():
            self._miss(parts)
            return None
        try:
            meta = json.loads((d / META).read_text())
            artifact = d / ARTIFACTS[meta["kind"]]
            digest = hashlib.sha256(artifact.read_bytes() + (d / INPUTS).read_bytes()).hexdigest()
            if digest != meta["sha256"] or meta.get("key") != key:
                raise ValueError("sha256 mismatch")
            recorded = json.loads((d / INPUTS).read_text())
            inputs = resolve_inputs(recorded["names"], recorded["meta"], model, tensors)
            if meta["kind"] == "aoti":
                fn = aoti.load(artifact, model.device)
            else:
                from torch._inductor import CompiledArtifact

                with self.cpp_builds(model.device):
                    fn = CompiledArtifact.load(path=str(artifact), format="binary")
        except Exception as e:  # noqa: BLE001 - any damage: remove, log, compile instead
            self.corrupt += 1
            log.warning("compile cache: entry %s of %s is damaged (%s: %s); removing it and compiling",
                        key[:16], parts.get("unit"), type(e).__name__, e)
            shutil.rmtree(d, ignore_errors=True)
            self.misses += 1
            return None
        self.loads += 1
        return Loaded(fn=fn, inputs=inputs, meta=meta)

    def scratch(self, suffix: str) -> Path:
        """A new empty file's path under `root/tmp` (for a package being compiled: the same filesystem as the
        entries, and removed by `clear`). Files there older than a day (left by a process killed mid-compile) are
        removed first."""
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        for old in (self.root / "tmp").iterdir():
            with contextlib.suppress(OSError):
                if time.time() - old.stat().st_mtime > 86400:
                    old.unlink()
        fd, name = tempfile.mkstemp(dir=self.root / "tmp", suffix=suffix)
        os.close(fd)
        return Path(name)

    def save(self, key: str, parts: dict, artifact, names: list[str], inputs: list[torch.Tensor],
             extra: dict | None = None) -> None:
        """Write the entry (the artifact: an AOTInductor package file's path, copied, or Inductor's own
        `CompiledArtifact`, saved; its inputs' names and `tensor_meta`; the record, with the artifact's kind) under a
        temporary name, then rename it into place; a concurrent writer's entry, if it got there first, is kept, and
        counts as saved. A failure to write is logged, never raised: the compiled step still runs."""
        final = self._dir(key)
        kind = "aoti" if isinstance(artifact, (str, Path)) else "inductor"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{key[:16]}."))
            if kind == "aoti":
                shutil.copyfile(artifact, tmp / ARTIFACTS[kind])
            else:
                artifact.save(path=str(tmp / ARTIFACTS[kind]), format="binary")
            (tmp / INPUTS).write_text(json.dumps({"names": names, "meta": [tensor_meta(t) for t in inputs]}))
            digest = hashlib.sha256((tmp / ARTIFACTS[kind]).read_bytes() + (tmp / INPUTS).read_bytes()).hexdigest()
            meta = {"key": key, "parts": parts, "kind": kind, "sha256": digest, "created": time.time(),
                    **(extra or {})}
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
            os.chmod(tmp, 0o755)  # mkdtemp's 0700: other users sharing the cache may read it
            try:
                os.rename(tmp, final)
            except OSError:  # another process filled the entry first: keep its (it is whole: renamed into place)
                shutil.rmtree(tmp, ignore_errors=True)
            if self.has(key):
                self.saves += 1
        except Exception as e:  # noqa: BLE001 - the cache is an optimisation: log and go on
            log.warning("compile cache: could not save %s (%s: %s)", parts.get("unit"), type(e).__name__, e)
            with contextlib.suppress(NameError):
                shutil.rmtree(tmp, ignore_errors=True)

    def cpp_builds(self, device: torch.device):
        """`cpp_store.building_from(self.cpp, device)`: Inductor's C++ builds through this store."""
        from .cpp_store import building_from

        return building_from(self.cpp, device)

    def _miss(self, parts: dict) -> None:
        self.misses += 1
        reason = "no entry"
        near = self._nearest(parts)
        if near is not None:
            diff = sorted(k for k in parts.keys() | near.keys() if parts.get(k) != near.get(k))
            if "sources" in diff and isinstance(near.get("sources"), dict):  # name the rooms whose sources changed
                ours, theirs = parts["sources"], near["sources"]
                rooms = sorted(r for r in ours.keys() | theirs.keys() if ours.get(r) != theirs.get(r))
                diff[diff.index("sources")] = f"sources ({', '.join(rooms)})"
            reason = "differs from a cached entry of the same unit in: " + ", ".join(diff)
        self.miss_reasons.append((parts.get("unit"), reason))
        log.info("compile cache: miss for %s (%s)", parts.get("unit"), reason)

    def _nearest(self, parts: dict) -> dict | None:
        """The key parts of the newest entry of the same unit, if any (for a miss's reason)."""
        best = None
        for meta in (self.root / "steps").glob("*/*/" + META):
            try:
                m = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
            if m.get("parts", {}).get("unit") == parts.get("unit") and (best is None or m["created"] > best["created"]):
                best = m
        return None if best is None else best["parts"]

    def entries(self) -> list[dict]:
        """Every entry's record (meta.json), with its size in bytes."""
        out = []
        for meta in sorted((self.root / "steps").glob("*/*/" + META)):
            with contextlib.suppress(OSError, ValueError):
                m = json.loads(meta.read_text())
                m["bytes"] = sum(p.stat().st_size for p in meta.parent.iterdir())
                out.append(m)
        return out

    def clear(self) -> list[str]:
        """Remove every entry (steps, C++ builds, background compile logs and locks); returns what could not be
        removed (empty: all of it)."""
        failed: list[str] = []
        for sub in ("steps", "cpp", "logs", "locks", "tmp"):
            if (self.root / sub).exists():
                shutil.rmtree(self.root / sub, onerror=lambda _f, path, exc: failed.append(f"{path}: {exc[1]}"))
        return failed


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)

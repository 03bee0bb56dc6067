"""Compiled steps kept on disk, so that a later process loads a batch size's step instead of tracing and compiling it.

One artifact per compile unit: Inductor's output for the unit's one graph (`torch._inductor.standalone_compile(...,
aot=True)`, AOTAutograd's wrappers and the generated code bundled, saved in its binary format), the names of the
tensors it takes, in order (the model's parameters and buffers by name, the bucket's buffers by position), and a
readable record of its key. Loading one runs no Dynamo trace, no AOTAutograd and no Inductor codegen; its C++ comes
from the `cpp_store.CppStore` beside it, so a new venv or an empty Inductor cache runs no g++ either.

Where: `cache_root()`: `$DGEMMA_CACHE_DIR`, else `$XDG_CACHE_HOME/dgemma_compile`, else `~/.cache/dgemma_compile`;
`steps/` holds the artifacts and `cpp/` the C++ builds. `DGEMMA_CACHE=off` turns both off (every process compiles,
as torch.compile alone would); `dgemma cache info | clear` shows and empties it.

The key (`step_key`) is what the artifact depends on, and nothing else: the format version; torch's version and
Python's; the device (and for a CPU, its ISA as the compiler sees it); the intra-op thread count (Inductor's CPU
kernels are generated for it); every `CompileOptions` field that reaches the graph; the model's structure (per
parameter and buffer its name, dtype, device, shape and stride; the plain constants of its modules; not its values,
which are inputs); the unit's name and structural config and its buffers' dtypes, shapes and strides; and the
sha256 of every source file of the `dgemma_compile` package (our passes and decompositions included). A changed
source or option is therefore a miss, never a stale load (tests/test_artifacts.py changes each and checks).

A miss is logged with its reason (no entry, or the differing parts of the nearest entry of the same unit); an entry
is written under a temporary name and renamed into place (two processes filling one entry keep one whole entry); an
entry whose bytes do not match their recorded sha256, or that fails to load, is logged, removed and rebuilt.
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

from .cpp_store import CppStore, cpu_identity

log = logging.getLogger("dgemma_compile")

FORMAT = "dgemma-step-artifact/1"
ARTIFACT, INPUTS, META = "artifact.bin", "inputs.json", "meta.json"
NOT_IN_KEY = ("artifact_cache",)
"""`CompileOptions` fields that cannot change a compiled graph (they decide only whether this store is used)."""


def cache_root() -> Path | None:
    """The user-level cache directory, or None when `DGEMMA_CACHE` is off (0, off, false, no)."""
    if os.environ.get("DGEMMA_CACHE", "").strip().lower() in ("0", "off", "false", "no"):
        return None
    if os.environ.get("DGEMMA_CACHE_DIR", "").strip():
        return Path(os.environ["DGEMMA_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "dgemma_compile"


@functools.cache
def sources_digest(package_dir: str | None = None) -> str:
    """sha256 over every `.py` file of the dgemma_compile package (relative path and bytes, sorted)."""
    root = Path(package_dir) if package_dir else Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


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
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    if device.type == "cpu":
        return f"cpu {cpu_identity()}"
    return device.type


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
        "model": hashlib.sha256(json.dumps(model_structure(model)).encode()).hexdigest(),
        "model_config": _plain(vars(model.config)) if hasattr(model, "config") else None,
        "unit": unit,
        "structure": _plain(structure),
        "buffers": [[str(t.dtype), list(t.shape), list(t.stride())] for t in tensors],
        "sources": sources_digest(),
    }


def step_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


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


def resolve_inputs(names: list[str], model: torch.nn.Module, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors `names` (`input_names`) denote now. Raises KeyError for a name that denotes nothing."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    out = []
    for n in names:
        kind, _, rest = n.partition(":")
        out.append(tensors[int(rest)] if kind == "bucket" else params[rest] if kind == "param" else buffers[rest])
    return out


@dataclass
class Loaded:
    """A loaded artifact: its callable, the names of its inputs and its record (meta.json)."""

    fn: object
    names: list[str]
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
        """The store at `cache_root()`, or None when the cache is off."""
        root = cache_root()
        return None if root is None else cls(root)

    def _dir(self, key: str) -> Path:
        return self.root / "steps" / key[:2] / key

    def has(self, key: str) -> bool:
        """Whether an entry for `key` is in place (`load` still checks it whole)."""
        return (self._dir(key) / META).is_file()

    def load(self, key: str, parts: dict) -> Loaded | None:
        """The artifact of `key`, or None (a miss: logged with its reason; a damaged entry removed)."""
        d = self._dir(key)
        if not (d / META).is_file():
            self._miss(parts)
            return None
        try:
            meta = json.loads((d / META).read_text())
            names = json.loads((d / INPUTS).read_text())
            data = (d / ARTIFACT).read_bytes()
            if hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise ValueError("sha256 mismatch")
            from torch._inductor import CompiledArtifact

            with self.cpp_builds():
                fn = CompiledArtifact.load(path=str(d / ARTIFACT), format="binary")
        except Exception as e:  # noqa: BLE001 - any damage: remove, log, compile instead
            self.corrupt += 1
            log.warning("compile cache: entry %s of %s is damaged (%s: %s); removing it and compiling",
                        key[:16], parts.get("unit"), type(e).__name__, e)
            shutil.rmtree(d, ignore_errors=True)
            self.misses += 1
            return None
        self.loads += 1
        return Loaded(fn=fn, names=names, meta=meta)

    def save(self, key: str, parts: dict, artifact, names: list[str], extra: dict | None = None) -> None:
        """Write the entry under a temporary name, then rename it into place (a concurrent writer's entry, if it got
        there first, is kept). A failure to write is logged, never raised: the compiled step still runs."""
        final = self._dir(key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{key[:16]}."))
            artifact.save(path=str(tmp / ARTIFACT), format="binary")
            digest = hashlib.sha256((tmp / ARTIFACT).read_bytes()).hexdigest()
            (tmp / INPUTS).write_text(json.dumps(names))
            meta = {"key": key, "parts": parts, "sha256": digest, "created": time.time(), **(extra or {})}
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
            try:
                os.rename(tmp, final)
                self.saves += 1
            except OSError:  # another process filled the entry first: keep its
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - the cache is an optimisation: log and go on
            log.warning("compile cache: could not save %s (%s: %s)", parts.get("unit"), type(e).__name__, e)
            with contextlib.suppress(NameError):
                shutil.rmtree(tmp, ignore_errors=True)

    def cpp_builds(self):
        """`cpp_store.building_from(self.cpp)`: Inductor's C++ builds through this store."""
        from .cpp_store import building_from

        return building_from(self.cpp)

    def _miss(self, parts: dict) -> None:
        self.misses += 1
        reason = "no entry"
        near = self._nearest(parts)
        if near is not None:
            diff = sorted(k for k in parts.keys() | near.keys() if parts.get(k) != near.get(k))
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

    def clear(self) -> None:
        """Remove every entry (steps and C++ builds)."""
        shutil.rmtree(self.root / "steps", ignore_errors=True)
        shutil.rmtree(self.root / "cpp", ignore_errors=True)

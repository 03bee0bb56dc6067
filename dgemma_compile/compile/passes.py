"""The ordered pipeline of our graph passes, as Inductor custom passes with a cache-safe `uuid()`.

`PASSES` is the one ordered registry: (name, module) pairs; each module has `NAME`, `STAGE` (the Inductor hook it
runs at: "joint_custom_pre_pass", "post_grad_custom_pre_pass" or "post_grad_custom_post_pass") and
`apply(graph, **settings) -> dict[str, int]` (its counts: its matches under its own name, and any details under
"name.detail"; its settings come from `CompileOptions.pass_settings()`).
`inductor_config(disabled, settings)` returns the Inductor settings that install the enabled passes, one
`PassPipeline` per stage used.

Cache safety: the compile caches (AOTAutograd's and Inductor's FX graph cache) put each custom pass's `uuid()` in
their keys. A `PassPipeline`'s uuid hashes the source files of this package, of the ops its passes insert and of the
sampler its pattern is traced from, plus the enabled passes' names and settings: editing a pass, turning one off or
changing a setting can never be served a stale rewrite.

Counting: a pass runs only when the graph is really compiled (not when AOTAutograd's cache serves it;
`torch._dynamo.explain` never reaches Inductor), so each run reports its matches to the innermost `recording()`
block; `compile/pass_records.py` keeps them beside the cache for the compiles the cache serves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections import Counter
from pathlib import Path

import torch

from ..kernels.sample import fusion as sample_step_fusion
from ..model.config import ConfigError

PASSES = ((sample_step_fusion.NAME, sample_step_fusion),)
"""The pipeline, in order."""
PASS_NAMES = tuple(name for name, _ in PASSES)
STAGES = ("joint_custom_pre_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass")

_PACKAGE = Path(__file__).parent.parent
_SOURCES = tuple(str(_PACKAGE / f) for f in ("compile/passes.py", "compile/pass_records.py", "step/sampler.py",
                                             "compile/lowerings.py")) + \
    tuple(sorted(str(p) for p in (_PACKAGE / "kernels" / "sample").glob("*.py")))
"""What the passes' rewrites depend on: this pipeline, its records, each pass's kernel folder (the pass, the op it
puts in place and its kernels) and the oracle math the pass matches (`step/sampler.py`); and our ops' lowerings
(`lowerings.py`), which Inductor's own cache keys do not see (its FX-graph cache would serve code lowered without
them)."""

_recorders: list[Counter] = []


@contextlib.contextmanager
def recording():
    """Collect the match counts of every pass that runs inside the block: yields a Counter {pass name: matches},
    with an entry (possibly 0) for each pass that ran."""
    counts: Counter = Counter()
    _recorders.append(counts)
    try:
        yield counts
    finally:
        _recorders.remove(counts)


@functools.cache
def sources_hash() -> str:
    """sha256 (hex) of the pass sources (`_SOURCES`), read once per process."""
    h = hashlib.sha256()
    for path in _SOURCES:
        h.update(Path(path).read_bytes())
    return h.hexdigest()


@functools.cache
def _register() -> None:
    """Make `PassPipeline` an Inductor `CustomGraphPass` (a virtual subclass: Inductor's cache keys take a custom pass's
    `uuid()` only from an instance of it). Done when the first pipeline is made, not at import: importing
    `torch._inductor` imports Dynamo too (about 2 s), which `import dgemma_compile` and `build` should not pay."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    CustomGraphPass.register(PassPipeline)


class PassPipeline:
    """The enabled passes of one stage, run in `PASSES` order on the graph Inductor hands over: an Inductor
    `CustomGraphPass` (`_register`)."""

    def __init__(self, stage: str, names: tuple[str, ...], settings: dict | None = None):
        _register()
        self.stage, self.names = stage, names
        self.settings = {name: dict((settings or {}).get(name, {})) for name in names}

    def __call__(self, graph: torch.fx.Graph) -> None:
        for name, module in PASSES:
            if name in self.names:
                found = module.apply(graph, **self.settings[name])
                for counts in _recorders[-1:]:
                    counts.update(found)
        graph.lint()

    def uuid(self) -> str:
        settings = ";".join(f"{n}:{sorted(self.settings[n].items())!r}" for n in self.names)
        return f"dgemma-passes:{self.stage}:{','.join(self.names)}:{settings}:{sources_hash()}"


def check_names(names, field: str = "disabled_passes") -> None:
    """Raises ConfigError (a ValueError) naming `field` for a name that is not a pass."""
    unknown = [n for n in names if n not in PASS_NAMES]
    if unknown:
        raise ConfigError(field, f"unknown pass(es) {unknown}; the passes are {list(PASS_NAMES)}")


def inductor_config(disabled: tuple[str, ...] = (), settings: dict | None = None) -> dict:
    """Inductor config entries installing every pass not in `disabled`, one `PassPipeline` per stage that has one;
    `settings`: {pass name: keyword arguments of its `apply`}. Raises ValueError for an unknown name in `disabled`."""
    check_names(disabled)
    out = {}
    for stage in STAGES:
        names = tuple(name for name, m in PASSES if m.STAGE == stage and name not in disabled)
        if names:
            out[stage] = PassPipeline(stage, names, settings)
    return out


@contextlib.contextmanager
def cache_key(pass_config: dict):
    """Around a compile with `pass_config` installed: appends the pipelines' uuids (hashed) to
    `torch.compiler.config.cache_key_tag`. torch 2.13's cache keys already cover custom passes' uuids; the tag keeps
    that true whatever the torch version (the project supports 2.11 to 2.13), at the cost of a string. The sources'
    hash is in it also with every pass disabled: it covers our ops' lowerings (`lowerings.py`), which every compile
    uses."""
    digest = hashlib.sha256("|".join([sources_hash()] + [f"{s}={p.uuid()}" for s, p in sorted(pass_config.items())])
                            .encode())
    ours = "dgemma-passes-" + digest.hexdigest()[:16]
    tag = torch.compiler.config.cache_key_tag
    with torch.compiler.config.patch(cache_key_tag=f"{tag}|{ours}" if tag else ours):
        yield

"""Pass match counts kept beside Inductor's on-disk cache, so that a compile the caches serve (where no pass
runs) still reports what the passes matched when the entry was made.

A record's key is a hash of what decides the passes' input and behaviour: the Dynamo graph's code (with its
subgraphs', comments left out: they name source files, so a fresh clone would miss every record), its inputs' dtypes, shapes and strides, the installed pipelines' uuids (pass sources and enabled names),
the compile's `cache_key_tag` (our decompositions' hash) and the torch version. Records live in
`<Inductor cache dir>/dgemma_pass_counts/<key>.json`; a lost record only means "unknown", never a wrong count.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch


def record_key(gm: torch.fx.GraphModule, example_inputs, pass_config: dict) -> str:
    """sha256 hex of the graph, its inputs' metadata, the pipelines' uuids, the cache tag and the torch version."""
    h = hashlib.sha256()
    for name, module in gm.named_modules():
        if isinstance(module, torch.fx.GraphModule):  # comments name source files: the same graph in another clone
            code = "\n".join(ln for ln in module.code.splitlines() if not ln.lstrip().startswith("#"))
            h.update(f"{name}\n{code}\n".encode())
    for x in example_inputs:
        meta = (x.dtype, tuple(x.shape), x.stride(), x.device.type) if isinstance(x, torch.Tensor) else repr(x)
        h.update(repr(meta).encode())
    for stage in sorted(pass_config):
        h.update(f"{stage}={pass_config[stage].uuid()}".encode())
    h.update(f"{torch.compiler.config.cache_key_tag}|{torch.__version__}".encode())
    return h.hexdigest()


def _path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "dgemma_pass_counts" / f"{key}.json"


def save(key: str, counts: dict[str, int]) -> None:
    """Write the record atomically (a concurrent reader sees the old file or the new one)."""
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(counts), sort_keys=True))
    os.replace(tmp, path)


def load(key: str) -> dict[str, int] | None:
    """The record for `key`, or None when there is none (or it is unreadable)."""
    try:
        return {str(k): int(v) for k, v in json.loads(_path(key).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return None

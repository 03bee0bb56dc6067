"""`dgemma cache info|clear`: the compile cache's directory and entries, or their removal."""

from __future__ import annotations

import os
import time

from .args import CacheArgs


def cache_command(args: CacheArgs) -> int:
    """`dgemma cache info|clear`: the compile cache's directory and entries (unit, bytes, age), or remove them."""
    from ..compile.artifacts import ArtifactStore, cache_root
    from ..model.config import ConfigError

    if cache_root() is None:
        print(f"compile cache: off (DGEMMA_CACHE={os.environ.get('DGEMMA_CACHE')})")
        return 0
    store = ArtifactStore.default()
    if store is None:
        raise ConfigError("cache", f"{cache_root()} is not a usable directory (DGEMMA_CACHE_DIR, XDG_CACHE_HOME)")
    if args.action == "clear":
        failed = store.clear()
        if failed:
            raise ConfigError("cache", f"could not remove {len(failed)} path(s) under {store.root}: {failed[0]}")
        print(f"compile cache: cleared {store.root}")
        return 0
    entries = store.entries()
    cpp = sum(f.stat().st_size for f in store.cpp.root.rglob("*.bin")) if store.cpp.root.is_dir() else 0
    print(f"compile cache: {store.root} ({len(entries)} steps, "
          f"{sum(e['bytes'] for e in entries) / 2**20:.1f} MiB; C++ builds {cpp / 2**20:.1f} MiB)")
    now = time.time()
    for e in sorted(entries, key=lambda e: e["created"]):
        parts = e["parts"]
        print(f"  {parts['unit']:<28} {e['bytes'] / 2**20:6.1f} MiB  {(now - e['created']) / 3600:7.1f} h old  "
              f"threads={parts['threads']} torch={parts['torch'].split()[0]} key={e['key'][:12]}")
    return 0

"""Schemathesis against a live `dgemma serve`: every response conforms to /openapi.json, no 5xx, data the schema
refuses is refused (issue 36, "one error shape and an honest schema").

Starts `dgemma serve --eager` on the demo model on a free loopback port (with an API key, so the auth checks run
too), waits for /health, runs the `schemathesis` CLI with every check on, prints its report and exits with its code.
schemathesis is not a dependency of the package or the suite: install it apart, e.g.

    python3.11 -m venv .venv-st && .venv-st/bin/pip install schemathesis
    python -m bench.schemathesis --schemathesis .venv-st/bin/schemathesis --max-time 120

Checks that do not apply are excluded with their reason (`EXCLUDED`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from .server import running_server

KEY = "bench-schemathesis-key"
EXCLUDED = {
    # the schema cannot say which prompts exceed the context, which text the tokenizer cannot encode, or which
    # constraints the grammar library refuses: valid-by-schema bodies may be 400s with their reason
    "positive_data_acceptance": "semantic refusals (context length, tokenizer, grammar) are 400s by design",
    # no resources are created or deleted
    "use_after_free": "no resources", "ensure_resource_availability": "no resources",
    "object_level_authorization": "one key, no per-object access",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.schemathesis", description=__doc__.split("\n\n")[0])
    p.add_argument("--schemathesis", default=shutil.which("schemathesis") or ".venv-st/bin/schemathesis",
                   help="the schemathesis executable (default: on PATH, else .venv-st/bin/schemathesis)")
    p.add_argument("--max-time", type=int, default=120, help="seconds of fuzzing (schemathesis --max-time)")
    p.add_argument("--max-examples", type=int, default=50, help="examples per operation and phase")
    p.add_argument("--workers", default="1", help="schemathesis workers (default 1: a 2-core machine)")
    p.add_argument("--report", default=None, metavar="DIR", help="write schemathesis' JUnit report under DIR")
    args = p.parse_args(argv)
    if not Path(args.schemathesis).exists() and shutil.which(args.schemathesis) is None:
        print(f"schemathesis not found at {args.schemathesis}: see `python -m bench.schemathesis --help`",
              file=sys.stderr)
        return 2
    flags = ["--eager", "--max-batch", "2", "--max-seq-len", "256", "--max-queue", "8"]
    with running_server(flags, timeout_s=300, env={"DGEMMA_API_KEY": KEY}) as server:
        base = server.url
        cmd = [args.schemathesis, "run", base + "/openapi.json", "--checks", "all",
               "--exclude-checks", ",".join(EXCLUDED), "--max-time", str(args.max_time),
               "--max-examples", str(args.max_examples), "--workers", args.workers,
               "-H", f"Authorization: Bearer {KEY}", "--request-timeout", "60", "--suppress-health-check", "all"]
        if args.report:
            cmd += ["--report", "junit", "--report-dir", args.report]
        print("$", " ".join(c if KEY not in c else c.replace(KEY, "<key>") for c in cmd), flush=True)
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())

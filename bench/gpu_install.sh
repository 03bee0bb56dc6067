#!/usr/bin/env bash
# Installs the carried wheels (.gpu_carry/, made by bench/gpu_prepare.sh) offline into a target folder and prints the
# versions the run will use. bench/gpu_run.sh's first step on the GPU machine, and bench/gpu_versions_check.sh's
# install here: the same command in both places.
#
#   bash bench/gpu_install.sh [CARRY] [SITE]     # then: export PYTHONPATH=<repo>:SITE
#
# `--target` + PYTHONPATH, not a venv or --user: the image's python3 is itself a venv (/opt/torch/.venv, no user
# site), and its torch 2.11+cu130 / triton 3.6 must stay the ones imported; --no-deps, --no-index: nothing resolves
# and nothing is fetched (the GPU machine has no network). PYTHON (python3) is the interpreter.
set -euo pipefail
CARRY=${1:-${GPU_CARRY:-.gpu_carry}}
SITE=${2:-${GPU_SITE:-/tmp/dgemma_site}}
PY=${PYTHON:-python3}
[ -d "$CARRY" ] || { echo "gpu_install: no carry folder $CARRY (bench/gpu_prepare.sh makes it; name it in carry)" >&2; exit 1; }
rm -rf "$SITE"
PIP_NO_INDEX=1 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "$CARRY"/*.whl
head=$(git rev-parse HEAD 2>/dev/null || true)
if [ -f "$CARRY/SOURCE" ] && [ -n "$head" ] && [ "$(sed -n 's/^commit //p' "$CARRY/SOURCE")" != "$head" ]; then
    echo "gpu_install: note: the carried project wheel was built at another commit than this tree's HEAD"
fi
[ -f "$CARRY/SOURCE" ] && echo "gpu_install: carried project wheel: $(tr '\n' ' ' < "$CARRY/SOURCE")"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF'
import importlib.metadata as md, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for name in ("triton", "transformers", "tokenizers", "safetensors", "torchao", "xgrammar", "apache-tvm-ffi",
             "pydantic", "numpy", "dgemma-compile"):
    try:
        print(" ", name, md.version(name))
    except md.PackageNotFoundError:
        print(" ", name, "MISSING")
import torchao, xgrammar, dgemma_runtime  # noqa: E401,F401  the carried imports work
PYEOF

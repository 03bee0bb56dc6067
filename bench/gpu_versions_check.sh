#!/usr/bin/env bash
# Our code on the GPU machine's versions, proved on this CPU machine (issue 37):
#
#   bash bench/gpu_prepare.sh && bash bench/gpu_versions_check.sh
#
# 1. An "image" venv (GPU_IMAGE_VENV, default /tmp/dgemma_gpu_image) with the GPU image's Python-level versions:
#    Python 3.12 (GPU_IMAGE_PYTHON, default pyenv's 3.12), torch 2.11.0 (PyPI's build: CUDA 13, runs on the CPU;
#    ~4.5 GB with its nvidia-* libraries, made once and reused), triton 3.6.0, transformers 5.17.0, tokenizers 0.23.2,
#    safetensors 0.8.0, and the image's other packages we use; then the packages that the carry folder provides are
#    removed from it (pydantic & co., pulled by typer), so that the carried wheels are what is imported.
# 2. The carried wheels installed offline by bench/gpu_install.sh, the command bench/gpu_run.sh runs on the GPU.
# 3. Test-only packages the image lacks (fastapi, uvicorn, sse-starlette, openai, jsonschema: no GPU step uses them)
#    into a folder of their own, last on PYTHONPATH.
# 4. Runs, each under `timeout`: the fast tier (`-m "not slow"`, 2 workers: ~3 min here, cap 20 min), the demo's
#    main job compiled (`dgemma generate --compile always "sort 3 1 2 9 5="`, ~70 s, cap 10 min; its answer must be
#    "1 2 3 5 9"), and the tiny dry run of bench/h200.sh (full-tiny on the CPU, ~7 min, cap 20 min; its report must
#    exist). Logs and a summary in GPU_VERSIONS_OUT (default /tmp/dgemma_gpu_versions).
# Known, on these versions: per-row FP8 on a CPU fails in torch 2.11's `_scaled_mm` (per-tensor only on CPU; CUDA is
# fine): those tests skip with the reason (tests/conftest.py) and h200.sh's FP8 row is "n/a" on a CPU; triton 3.6's
# interpreter fails some interpreted kernels under numpy >= 2.5 (skipped likewise, CPU only).
# Deselected: test_startup_dry_run_plans_every_command_with_its_caches (needs the `dgemma` script beside the
# interpreter: an installed venv, not this --target layout).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${GPU_IMAGE_VENV:-/tmp/dgemma_gpu_image}
PY312=${GPU_IMAGE_PYTHON:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)}
PY312=${PY312:-python3.12}
OUTDIR=${GPU_VERSIONS_OUT:-/tmp/dgemma_gpu_versions}
SITE=$OUTDIR/site
TESTSITE=$OUTDIR/testsite
IMAGE_PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0
            jinja2 numpy tqdm rich pillow httpx prometheus-client pytest pytest-xdist hypothesis)
mkdir -p "$OUTDIR"
: > "$OUTDIR/summary.txt"
STATUS=0
note() { echo "$*" | tee -a "$OUTDIR/summary.txt"; }

have=$("$VENV/bin/python" -c "import torch, triton, transformers; print(torch.__version__.split('+')[0], triton.__version__, transformers.__version__)" 2>/dev/null)
if [ "$have" != "2.11.0 3.6.0 5.17.0" ]; then
    rm -rf "$VENV" && "$PY312" -m venv "$VENV" || exit 1
    # the only network step (PyPI): the image's own versions
    timeout 1800 "$VENV/bin/python" -m pip install -q --index-url "${GPU_IMAGE_INDEX:-https://pypi.org/simple}" \
        "${IMAGE_PINS[@]}" || exit 1
fi
carried=$(sed -e 's/#.*//' -e 's/==.*//' -e 's/[[:space:]]//g' bench/gpu_requirements.txt | grep . | grep -vx typing-extensions)
"$VENV/bin/python" -m pip uninstall -q -y $carried 2>/dev/null || true
PYTHON="$VENV/bin/python" bash bench/gpu_install.sh .gpu_carry "$SITE" 2>&1 | tee "$OUTDIR/install.log" || exit 1
if [ ! -d "$TESTSITE" ]; then
    timeout 600 "$VENV/bin/python" -m pip install -q --target "$TESTSITE" --index-url "${GPU_IMAGE_INDEX:-https://pypi.org/simple}" \
        "fastapi>=0.115" "uvicorn>=0.30" "sse-starlette>=2.1" "openai>=1.40" "jsonschema>=4.20,<5" || exit 1
fi

export PYTHONPATH="$REPO:$SITE:$TESTSITE" PATH="$SITE/bin:$VENV/bin:$PATH" PYTHON="$VENV/bin/python"
export DGEMMA_CACHE_DIR=$OUTDIR/dgemma_cache TORCHINDUCTOR_CACHE_DIR=$OUTDIR/inductor_cache OMP_NUM_THREADS=1
run() {  # run NAME CAP CMD...
    local name=$1 cap=$2; shift 2
    local t0=$SECONDS
    timeout -k 15 "$cap" "$@" > "$OUTDIR/$name.log" 2>&1
    local rc=$?
    note "$name: exit $rc in $((SECONDS - t0)) s (cap ${cap}s): $(tail -n 1 "$OUTDIR/$name.log")"
    [ $rc -ne 0 ] && STATUS=1
    return $rc
}
note "versions: $(grep -E '^(torch|  (triton|transformers|tokenizers|safetensors|torchao|xgrammar)) ' "$OUTDIR/install.log" | tr -s ' \n' ' ')"
run fast_tier 1200 "$VENV/bin/python" -m pytest -q -n 2 -m "not slow" -p no:cacheprovider \
    --deselect tests/bench/test_bench.py::test_startup_dry_run_plans_every_command_with_its_caches
run generate 600 "$VENV/bin/python" -m dgemma_compile.cli generate --compile always "sort 3 1 2 9 5="
grep -qx "1 2 3 5 9" "$OUTDIR/generate.log" || { note "generate: answer is not '1 2 3 5 9'"; STATUS=1; }
rm -rf "$OUTDIR/results"
BENCH_MODEL=full-tiny BENCH_DEVICE=cpu BENCH_PROMPT=64 BENCH_OUTPUT=128 BENCH_TIMEOUT_S=600 \
    BENCH_RESULTS="$OUTDIR/results" run h200_tiny 1200 bash bench/h200.sh
ls "$OUTDIR"/results/full-tiny_cpu_*.md >/dev/null 2>&1 || { note "h200_tiny: no report"; STATUS=1; }
grep -E "^\| (ours|ar)-" "$OUTDIR"/results/full-tiny_cpu_*.md 2>/dev/null | head -n 6 | tee -a "$OUTDIR/summary.txt"
note "gpu_versions_check: $([ $STATUS -eq 0 ] && echo ok || echo FAILED) (logs in $OUTDIR)"
exit $STATUS

#!/usr/bin/env bash
# The rehearsal of the GPU run on this CPU machine (issue 37): bench/gpu_run.sh end to end, as the device tool would
# run it, against a copy of what travels (tracked and untracked-not-ignored files, no .git) plus .gpu_carry/, with
# the network refused, on the GPU image's versions (the venv bench/gpu_versions_check.sh makes), every GPU step on
# its CPU fallback; then checks that $OUT received the reports within the tool's limits (at most 8 files, plain names).
#
#   bash bench/gpu_prepare.sh && bash bench/gpu_versions_check.sh   # once: the carry folder and the image venv
#   bash bench/gpu_rehearse.sh                                       # ~15-20 min on 2 busy cores
#
# Network refused: the run is in a network namespace of its own (`unshare -n`: no interface but loopback), where
# unshare works; and in any case PIP_NO_INDEX=1, pip's machine config dropped, an unreachable proxy, HF offline.
# CPU fallbacks: GPU_CHECK_DEVICE=cpu (bench/gpu_check.py --device cpu), BENCH_DEVICE=cpu with BENCH_MODEL=full-tiny
# (bench/h200.sh's tiny dry run). The budget is 2400 s instead of 525: a CPU compiles the same graphs far slower
# than the GPU host, and this run checks the plumbing, not the GPU's time box.
# Knobs: GPU_IMAGE_VENV (/tmp/dgemma_gpu_image), GPU_REHEARSE_DIR (/tmp/dgemma_rehearse), GPU_RUN_BUDGET_S (2400).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_IMAGE_VENV:-/tmp/dgemma_gpu_image}
DIR=${GPU_REHEARSE_DIR:-/tmp/dgemma_rehearse}
[ -x "$VENV/bin/python" ] || { echo "no image venv at $VENV: run bench/gpu_versions_check.sh first" >&2; exit 1; }
[ -d .gpu_carry ] || { echo "no .gpu_carry: run bench/gpu_prepare.sh first" >&2; exit 1; }
rm -rf "$DIR" && mkdir -p "$DIR/tree" "$DIR/out"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$DIR/tree" 2>/dev/null
cp -r .gpu_carry "$DIR/tree/"

NET=()
if unshare -n true 2>/dev/null; then NET=(unshare -n); fi
echo "gpu_rehearse: tree copied to $DIR/tree ($(du -sm "$DIR/tree" | cut -f1) MiB), network: ${NET[*]:-env only}"
t0=$(date +%s)
env -i HOME="$HOME" USER="${USER:-root}" TERM=dumb LANG=C.UTF-8 PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" \
    OUT="$DIR/out" PYTHON="$VENV/bin/python" \
    PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_INDEX_URL=http://127.0.0.1:9/simple \
    http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 \
    HTTPS_PROXY=http://127.0.0.1:9 no_proxy= HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    GPU_CHECK_DEVICE=cpu GPU_CHECK_REPEATS=3 GPU_CHECK_TIMEOUT_S=900 GPU_RUN_BUDGET_S="${GPU_RUN_BUDGET_S:-2400}" \
    GPU_SITE="$DIR/site" DGEMMA_CACHE_DIR="$DIR/dgemma_cache" TORCHINDUCTOR_CACHE_DIR="$DIR/inductor_cache" \
    BENCH_MODEL=full-tiny BENCH_DEVICE=cpu BENCH_PROMPT=64 BENCH_OUTPUT=128 OMP_NUM_THREADS=1 \
    ${NET[@]+"${NET[@]}"} bash "$DIR/tree/bench/gpu_run.sh"
rc=$?
wall=$(( $(date +%s) - t0 ))

fail=0
check() { if eval "$2"; then echo "  ok: $1"; else echo "  MISSING: $1"; fail=1; fi; }
echo "gpu_rehearse: gpu_run.sh exit $rc, wall ${wall}s; checking $DIR/out"
check "summary.txt, gpu_run.log, gpu_check.log, h200.log" \
      "[ -s $DIR/out/summary.txt ] && [ -s $DIR/out/gpu_run.log ] && [ -s $DIR/out/gpu_check.log ] && [ -s $DIR/out/h200.log ]"
check "the bench report (.md and .csv)" "ls $DIR/out/full-tiny_cpu_*.md $DIR/out/full-tiny_cpu_*.csv >/dev/null 2>&1"
check "tokens compiled == eager, batch 1 and 3" \
      "[ \$(grep -c 'tokens compiled == eager (batch [13]): True' $DIR/out/gpu_check.log) -eq 2 ]"
check "no wheel fetched (offline install)" "! grep -qiE 'Downloading|Collecting' $DIR/out/gpu_run.log"
check "at most 8 files, plain names, nothing nested" \
      "[ \$(find $DIR/out -type f | wc -l) -le 8 ] && ! find $DIR/out -mindepth 1 | grep -q '[^A-Za-z0-9._/-]' && [ -z \"\$(find $DIR/out -mindepth 1 -type d)\" ]"
ls -l "$DIR/out"
echo "gpu_rehearse: $([ $fail -eq 0 ] && echo ok || echo FAILED), gpu_run.sh exit $rc, wall ${wall}s"
exit $fail

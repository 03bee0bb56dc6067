#!/usr/bin/env bash
# The GPU run, one command, run as it is on the lent machine (made ready here by bench/gpu_prepare.sh):
#
#   run(kind="nvidia-h200", carry=[".gpu_carry"], timeout_s=600, command="bash bench/gpu_run.sh")
#
# nvidia-h200: the full model's ~50 GB of bf16 weights plus its FP8 copy while quantizing do not fit an H100's 80 GB.
# Steps, most valuable first, each under its own `timeout`, all of them inside GPU_RUN_BUDGET_S (default 525 s: the
# whole command ends within 9 minutes, under the tool's 10-minute command limit, and leaves the rest of a 15-minute
# lease to the machine's start and one short rerun):
#   1. setup (cap 60 s; ~5 s): the carried wheels installed offline (`pip install --no-index --no-deps --target`, put
#      on PYTHONPATH behind the tree: the image's torch 2.11 / triton 3.6 stay), versions, nvidia-smi;
#   2. `bench/gpu_check.py --part correctness` (cap 240 s: the demo's two compiles plus the checks; 90 s on
#      this 2-core CPU): compiled tokens
#      equal to the eager oracle on CUDA, each batch size's CUDA graph, the Observer hook, the Triton sample kernel;
#   3. `bench/h200.sh` (what is left but 15 s; each system up to 240 s, none past the run's deadline, so that a slow
#      system still leaves the earlier rows and the report): the FP8 row first (batch 1, against vLLM's 1,288 tok/s),
#      then bf16 ours-compiled, then the AR baseline;
#   4. `bench/gpu_check.py --part latency` with whatever time is left (skipped under 45 s).
# Everything lands in $OUT (the tool's folder that comes back; ./gpu_out when unset), at most 8 files (the tool's
# limit): gpu_run.log (everything), summary.txt (one line a step), gpu_check.log, gpu_latency.log, h200.log and the
# bench report (.md + .csv). A failing step is logged and the next one runs; the exit status is the first failure's.
# Knobs (environment): GPU_RUN_BUDGET_S, GPU_CARRY (.gpu_carry), GPU_SITE (where the wheels go: /tmp/dgemma_site),
# GPU_CHECK_DEVICE (cuda; cpu for the rehearsal), GPU_CHECK_REPEATS (20), GPU_CHECK_TIMEOUT_S (step 2's cap, 240),
# PYTHON (python3), every BENCH_* knob of
# bench/h200.sh (BENCH_SYSTEMS defaults here to ours-compiled-fp8,ours-compiled,ar-compiled).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
START=$(date +%s)
BUDGET=${GPU_RUN_BUDGET_S:-525}
export OUT=${OUT:-$REPO/gpu_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_run.log") 2>&1
PY=${PYTHON:-python3}
CARRY=${GPU_CARRY:-.gpu_carry}
SITE=${GPU_SITE:-/tmp/dgemma_site}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
STATUS=0

left() { echo $((START + BUDGET - $(date +%s))); }
# step NAME CAP LOG CMD...: runs CMD under `timeout` for min(CAP, time left), its output into $OUT/LOG (and this
# log; LOG "-": this log only)
step() {
    local name=$1 cap=$2 log=$3; shift 3
    local limit; limit=$(left); [ "$cap" -lt "$limit" ] && limit=$cap
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, ${limit}s left" | tee -a "$OUT/summary.txt"; return 0
    fi
    echo "== $name (timeout ${limit}s, $(date -u +%H:%M:%S) UTC): $*"
    local t0=$SECONDS rc
    if [ "$log" = - ]; then
        timeout -k 15 "$limit" "$@" 2>&1
        rc=$?
    else
        timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
        rc=${PIPESTATUS[0]}
    fi
    local verdict=ok; [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="TIMED OUT" ; [ "$rc" -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED"
    echo "== $name: $verdict (exit $rc, $((SECONDS - t0)) s of ${limit}s)" | tee -a "$OUT/summary.txt"
    [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ] && STATUS=$rc
    return 0
}

setup() {
    bash bench/gpu_install.sh "$CARRY" "$SITE" || return 1
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not here"; fi
}

# The tree's sources first (bench/, dgemma_compile/ as they travelled), then the carried wheels (dgemma_runtime,
# torchao, xgrammar, ...), then the image's site-packages.
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH" PYTHON="$PY"
echo "bench/gpu_run.sh: budget ${BUDGET}s, device $DEVICE, out $OUT ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
: > "$OUT/summary.txt"
export -f setup
export CARRY SITE
step setup 60 - bash -c setup
step gpu_check "${GPU_CHECK_TIMEOUT_S:-240}" gpu_check.log "$PY" bench/gpu_check.py --part correctness --device "$DEVICE" \
    --repeats "${GPU_CHECK_REPEATS:-20}"

systems=${BENCH_SYSTEMS:-ours-compiled-fp8,ours-compiled,ar-compiled}
h200_s=$(( $(left) - 15 ))  # 15 s: this script's own end (summary, listing)
# a fresh results folder: h200.sh copies its report from there into $OUT by the run's date
export BENCH_SYSTEMS=$systems BENCH_DEVICE=${BENCH_DEVICE:-$DEVICE} BENCH_RESULTS=${BENCH_RESULTS:-$(mktemp -d)}
# Each system may take up to BENCH_TIMEOUT_S (240 s: a full-model compile is estimated at ~3 min), in the order
# listed, but no wait goes past the run's deadline (h200_s less 30 s for h200.sh's start and its report): the first
# systems get the time they need, the last what is left, and the report is written either way.
export BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-240} BENCH_DEADLINE_S=${BENCH_DEADLINE_S:-$(( h200_s - 30 ))}
step h200 "$h200_s" h200.log bash bench/h200.sh
if [ "$(left)" -ge 45 ]; then
    step gpu_latency "$(left)" gpu_latency.log "$PY" bench/gpu_check.py --part latency --device "$DEVICE" \
        --repeats "${GPU_CHECK_REPEATS:-20}"
else
    echo "== gpu_latency: skipped, $(left)s left" | tee -a "$OUT/summary.txt"
fi
echo "bench/gpu_run.sh: done in $(( $(date +%s) - START ))s, exit $STATUS"
cat "$OUT/summary.txt"
ls -l "$OUT"
exit $STATUS

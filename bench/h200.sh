#!/usr/bin/env bash
# The whole GPU benchmark in one command (< 8 minutes on one H200):
#
#   bash bench/h200.sh
#
# Full DiffusionGemma-26B-A4B text architecture with random bf16 weights built directly on the GPU (no checkpoint),
# batch 1, 16 fixed denoise steps per block (confidence stop off, eos ignored), prompt 1024, output 1024 tokens
# (4 canvases of 256): ms per step and per canvas, tok/s, fraction of the H200 bandwidth floor (4.8e12 B/s,
# bench/roofline.py), for our compiled generator and for the autoregressive baseline on the same weights.
# Each system runs in its own worker process with a timeout, so one failing or slow system still leaves the other's
# row. On `full` the systems run one after another (--sequential): every worker holds its own copy of the ~50 GB of
# bf16 weights, and two or three copies alive at once do not fit safely in 141 GB. Elsewhere the timed repeats are
# interleaved round-robin across the live workers (the default of `python -m bench`).
# Results: bench/results/full_h200_<date>.{md,csv}, also copied into $OUT when that directory exists (device tool).
#
# The same code path runs on a CPU at a tiny size (a dry run of this script, ~ a few minutes):
#
#   BENCH_MODEL=full-tiny BENCH_DEVICE=cpu BENCH_PROMPT=64 BENCH_OUTPUT=128 bash bench/h200.sh
#
# Knobs (environment): BENCH_SYSTEMS (default ours-compiled,ar-compiled; add ours-eager for the eager ratio, ~2 more
# minutes), BENCH_REPEATS (2), BENCH_BUDGET_S (timed seconds per system before it stops repeating, 45),
# BENCH_TIMEOUT_S (per system, compile included, 300), BENCH_SCHEDULE (sequential on full, else interleaved),
# BENCH_RESULTS (bench/results), PYTHON (python).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${BENCH_MODEL:-full}
DEVICE=${BENCH_DEVICE:-cuda}
PROMPT=${BENCH_PROMPT:-1024}
OUTPUT=${BENCH_OUTPUT:-1024}
SYSTEMS=${BENCH_SYSTEMS:-ours-compiled,ar-compiled}
REPEATS=${BENCH_REPEATS:-2}
BUDGET=${BENCH_BUDGET_S:-45}
TIMEOUT=${BENCH_TIMEOUT_S:-300}
PY=${PYTHON:-python}
RESULTS=${BENCH_RESULTS:-bench/results}
if [ "$MODEL" = full ]; then SCHEDULE=${BENCH_SCHEDULE:-sequential}; else SCHEDULE=${BENCH_SCHEDULE:-interleaved}; fi
SCHEDULE_FLAG=()
if [ "$SCHEDULE" = sequential ]; then SCHEDULE_FLAG=(--sequential); fi

echo "bench/h200.sh: model=$MODEL device=$DEVICE prompt=$PROMPT output=$OUTPUT systems=$SYSTEMS repeats=$REPEATS" \
     "budget=${BUDGET}s timeout=${TIMEOUT}s schedule=$SCHEDULE ($(date -u +%H:%M:%S) UTC)"
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
fi

"$PY" -m bench --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --workloads fixed --batch 1 --steps 16 \
    --prompt-len "$PROMPT" --output-len "$OUTPUT" --repeats "$REPEATS" --systems "$SYSTEMS" \
    --budget-s "$BUDGET" --timeout-s "$TIMEOUT" --threads "${OMP_NUM_THREADS:-1}" --out "$RESULTS" ${SCHEDULE_FLAG[@]+"${SCHEDULE_FLAG[@]}"} \
    --note "bench/h200.sh; random weights (timings only, no quality)."

if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    cp "$RESULTS/${MODEL}_"*"_$(date -u +%Y-%m-%d)".* "$OUT"/ && echo "copied results to \$OUT"
fi
echo "bench/h200.sh: done ($(date -u +%H:%M:%S) UTC)"

#!/usr/bin/env bash
# The whole GPU benchmark in one command (never yet run on a GPU; the estimate is ~8-10 minutes on one H200, three
# compiles included):
#
#   bash bench/h200.sh
#
# Full DiffusionGemma-26B-A4B text architecture with random bf16 weights built directly on the GPU (no checkpoint),
# batch 1, 16 fixed denoise steps per block (confidence stop off, eos ignored), prompt 1024, output 1024 tokens
# (4 canvases of 256): ms per step and per canvas, tok/s, fraction of the H200 bandwidth floor (4.8e12 B/s,
# bench/roofline.py), for our compiled generator in bf16, the same compiled generator on the weights quantized to
# FP8 (BENCH_QUANT, default fp8: `dg.quantize(model, "fp8")` in the worker after building, before compiling,
# untimed; dynamic per-row fp8 activations, per-row fp8 weights) and the autoregressive baseline on the bf16 weights.
# The FP8 row is the one to hold against vLLM's published 1,288 tok/s for DiffusionGemma on an H200: that anchor is
# FP8 at batch 1. The report's "Quantized vs bfloat16 ours-compiled" table gives the FP8 row's weight bytes and its
# ratios to bf16 ours-compiled from the same run.
# Each system runs in its own worker process with a timeout, so one failing or slow system still leaves the other's
# row. On `full` the systems run one after another (--sequential): every worker holds its own copy of the ~50 GB of
# bf16 weights, and two or three copies alive at once do not fit safely in 141 GB. Elsewhere the timed repeats are
# interleaved round-robin across the live workers (the default of `python -m bench`).
# Results: bench/results/full_h200_<date>.{md,csv}, also copied into $OUT when that directory exists (device tool).
#
# Where compiles may not fit the default per-system timeout (540 s / 3 systems) under a 10-minute command limit, the
# FP8 row and its bf16 baseline alone, in one report:
#
#   BENCH_SYSTEMS=ours-compiled,ours-compiled-fp8 BENCH_TIMEOUT_S=270 bash bench/h200.sh
#
# The same code path runs on a CPU at a tiny size (a dry run of this script, ~7 minutes on 2 busy vCPUs: a CPU
# compiles slower than the GPU host, hence the longer timeout):
#
#   BENCH_MODEL=full-tiny BENCH_DEVICE=cpu BENCH_PROMPT=64 BENCH_OUTPUT=128 BENCH_TIMEOUT_S=600 bash bench/h200.sh
#
# Knobs (environment): BENCH_QUANT (comma list of quantization schemes, each adding a row ours-compiled-<scheme>:
# fp8 (default), fp8-weight-only, nvfp4-w4a16; `none` for bf16 only), BENCH_SYSTEMS (default
# ours-compiled,ours-compiled-<scheme>...,ar-compiled from BENCH_QUANT; given, it replaces that list and BENCH_QUANT
# is ignored; add ours-eager for the eager ratio, ~2 more minutes), BENCH_REPEATS (2), BENCH_BUDGET_S (timed seconds
# per system before it stops repeating, 45), BENCH_TIMEOUT_S (per system, compile included; default 540 s split over
# the systems, 180 s each for three, so that the whole run stays under a 10-minute command limit: raise it where
# commands may run longer), BENCH_DEADLINE_S (all systems together: no system's wait goes past this many seconds from
# the start, the report is still written; unset: none), BENCH_SCHEDULE (sequential on full, else interleaved), BENCH_RESULTS (bench/results),
# PYTHON (python).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${BENCH_MODEL:-full}
DEVICE=${BENCH_DEVICE:-cuda}
PROMPT=${BENCH_PROMPT:-1024}
OUTPUT=${BENCH_OUTPUT:-1024}
QUANT=${BENCH_QUANT:-fp8}
if [ -n "${BENCH_SYSTEMS:-}" ]; then
    SYSTEMS=$BENCH_SYSTEMS
else
    SYSTEMS=ours-compiled
    if [ "$QUANT" != none ]; then
        for scheme in ${QUANT//,/ }; do SYSTEMS="$SYSTEMS,ours-compiled-$scheme"; done
    fi
    SYSTEMS="$SYSTEMS,ar-compiled"
fi
N_SYSTEMS=$(echo "$SYSTEMS" | tr ',' '\n' | grep -c .)
REPEATS=${BENCH_REPEATS:-2}
BUDGET=${BENCH_BUDGET_S:-45}
TIMEOUT=${BENCH_TIMEOUT_S:-$((540 / N_SYSTEMS))}
PY=${PYTHON:-python}
RESULTS=${BENCH_RESULTS:-bench/results}
if [ "$MODEL" = full ]; then SCHEDULE=${BENCH_SCHEDULE:-sequential}; else SCHEDULE=${BENCH_SCHEDULE:-interleaved}; fi
SCHEDULE_FLAG=()
if [ "$SCHEDULE" = sequential ]; then SCHEDULE_FLAG=(--sequential); fi
if [ -n "${BENCH_DEADLINE_S:-}" ]; then SCHEDULE_FLAG+=(--deadline-s "$BENCH_DEADLINE_S"); fi

echo "bench/h200.sh: model=$MODEL device=$DEVICE prompt=$PROMPT output=$OUTPUT systems=$SYSTEMS quant=$QUANT repeats=$REPEATS" \
     "budget=${BUDGET}s timeout=${TIMEOUT}s deadline=${BENCH_DEADLINE_S:-none} schedule=$SCHEDULE ($(date -u +%H:%M:%S) UTC)"
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
fi

"$PY" -m bench --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --workloads fixed --batch 1 --steps 16 \
    --prompt-len "$PROMPT" --output-len "$OUTPUT" --repeats "$REPEATS" --systems "$SYSTEMS" \
    --budget-s "$BUDGET" --timeout-s "$TIMEOUT" --threads "${OMP_NUM_THREADS:-1}" --out "$RESULTS" ${SCHEDULE_FLAG[@]+"${SCHEDULE_FLAG[@]}"} \
    --note "bench/h200.sh; random weights (timings only, no quality). Anchor: vLLM serves DiffusionGemma at 1,288 tok/s on one H200 in FP8 at batch 1 (compare the ours-compiled-fp8 row)."

if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    cp "$RESULTS/${MODEL}_"*"_$(date -u +%Y-%m-%d)".* "$OUT"/ && echo "copied results to \$OUT"
fi
echo "bench/h200.sh: done ($(date -u +%H:%M:%S) UTC)"

#!/usr/bin/env bash
# The Flash-slice sweep (DeepInfer's name): deepinfer bf16, deepinfer FP8/FP4 and transformers bf16
# on V4-Flash's first four layers at full width, and deepinfer-v41 bf16 / FP8+FP4 on a V4.1-Flash
# slice at full width (one layer of every CSA2 role, cache in the reference formats); prefill 1x2048 /
# 4x2048 / 1x8192 and decode at batch 1-128 x context 256 / 4096, each row with its roofline, in one
# run; deepinfer's rows time the engine's own step (flash_slice.py's TIMING says what each row covers;
# its V4.1 decode rows time 5 steps per rep against V4's 10, to keep the sweep short).
# ENGINES (comma-separated) picks the engines; the V4 and V4.1 rows share a run when it names both.
# Writes benchmarks/results/<date>-<gpu>.json (+ .png where matplotlib is installed) unless RESULTS is set
# to another path; --smoke (tiny widths on the CPU) writes under a fresh temporary directory instead.
# Its last line names the files written. COMMIT=<hash> is recorded instead of git's HEAD.
# Then (EXECUTOR_ROWS=0 skips them) the executor rows: the multi-process executor at one rank against the
# in-process engine on both slices, decode at batch 1 and 64 (benchmarks/executor_overhead.py; its own
# results file, <date>-<gpu>-executor-overhead-<commit>.json, named on the last line).
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--engines "${ENGINES:-deepinfer,deepinfer-fp8,deepinfer-v41,deepinfer-v41-fp8,transformers}" --reps "${REPS:-3}")
[ -n "${RESULTS:-}" ] && args+=(--out "$RESULTS")
commit=()
[ -n "${COMMIT:-}" ] && commit=(--commit "$COMMIT")
PYTHONPATH=. python3 benchmarks/flash_slice.py "${args[@]}" "${commit[@]}" "$@"
if [ "${EXECUTOR_ROWS:-1}" != 0 ]; then
  rows=(--batches 1,64)
  [[ " $* " == *" --smoke "* ]] && rows=(--smoke --batches 1,2 --steps 4 --reps 1)  # the script's check
  (cd benchmarks && PYTHONPATH=.. python3 executor_overhead.py --slices v4,v41 "${rows[@]}" "${commit[@]}")
fi

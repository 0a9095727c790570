#!/usr/bin/env bash
# The Flash-slice sweep (DeepInfer's name): deepinfer bf16, deepinfer FP8/FP4 and transformers bf16
# on V4-Flash's first four layers at full width, prefill 1x2048 / 4x2048 / 1x8192 and decode at
# batch 1-128 x context 256 / 4096, each row with its measured roofline, in one run; deepinfer's rows time
# the engine's own step (flash_slice.py's TIMING says what each row covers).
# Writes benchmarks/results/<date>-<gpu>.json (+ .png where matplotlib is installed) unless RESULTS is set
# to another path; --smoke (tiny widths on the CPU) writes under a fresh temporary directory instead.
# The last line names the files written. COMMIT=<hash> is recorded instead of git's HEAD.
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--engines "${ENGINES:-deepinfer,deepinfer-fp8,transformers}" --reps "${REPS:-3}")
[ -n "${RESULTS:-}" ] && args+=(--out "$RESULTS")
[ -n "${COMMIT:-}" ] && args+=(--commit "$COMMIT")
PYTHONPATH=. exec python3 benchmarks/flash_slice.py "${args[@]}" "$@"

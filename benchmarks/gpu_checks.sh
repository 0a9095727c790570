#!/usr/bin/env bash
# The GPU checks of a device session in one call: every gpu-marked test (kernels first; a failure
# does not stop the rest), then the batch-invariance "1000 completions" run. Logs go to $1 (default benchmarks/results/gpu-checks);
# $2 picks a part (tests | tests-kernels | tests-other | tests-more | identical | probes | spec[-equal|-oracle|-dspark]
# | all, default all; spec, the speculative decoding runs of benchmarks/spec_decode.py, only when named);
# probes = the decode-size kernel sweep, the GEMM tile probe (benchmarks/mma_rows_probe.py) and a decode
# batch 1 profile with GEMM shapes.
#   COMMIT=<hash> bash benchmarks/gpu_checks.sh "$OUT" tests
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu-checks}"
what="${2:-all}"
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the probes run from benchmarks/
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" TORCHDYNAMO_DISABLE=1  # keep what the caller put there (nemo_automodel, xgrammar)
# COMMIT (a hash) is recorded instead of git's answer: a copied tree's .git may be stale
commit_arg=()
[ -n "${COMMIT:-}" ] && commit_arg=(--commit "$COMMIT")
commit=${COMMIT:-$(cd benchmarks && python3 -c "from common import git_commit; print(git_commit())")}
echo "# commit $commit, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" | tee "$out/summary.txt"
# The NeMo-backed GPU tests need nemo_automodel, which the device does not have: carry a copy without
# __pycache__ (.venv/nemo_carry/nemo_automodel, 13.5 MB: the installed folder is 31 MB, and with the tracked
# tree's ~38 MB it passes the device's 64 MiB carry limit) and put a folder holding it on PYTHONPATH
# (a link to it, not the whole site-packages: that would shadow the device's torch). Make the copy with
#   mkdir -p .venv/nemo_carry && (cd .venv/lib/python3.11/site-packages && tar --exclude=__pycache__ -cf - \
#     nemo_automodel) | (cd .venv/nemo_carry && tar -xf -)
python3 -c "import nemo_automodel" 2>/dev/null \
  || echo "nemo_automodel not importable: the NeMo-backed GPU tests will error" | tee -a "$out/summary.txt"
# tests-kernels / tests-other: the two halves of `tests` (all of it takes more than one 600 s device call:
# tests/kernels alone ran past 330 s on the H200 at 80721a5)
# (tests-more: the distributed ranks sharing one GPU, training's bf16 steps (needs nemo_automodel), eval)
parts=(tests/kernels "tests/models tests/layers" tests/engine "tests/state tests/spec tests/worker tests/structured"
       "tests/distributed tests/training tests/eval")
[ "$what" = tests-kernels ] && parts=(tests/kernels)
[ "$what" = tests-other ] && parts=("${parts[@]:1:3}")
[ "$what" = tests-more ] && parts=("${parts[@]:4}")
if [[ "$what" =~ ^(tests|all|tests-kernels|tests-other|tests-more)$ ]]; then
  # GPU_WORKERS pytest-xdist workers share the GPU where xdist is importable (carry its wheel): most of a
  # part's time is Triton compiling on the host's cores; PART_TIMEOUT bounds each part (seconds)
  xdist=()
  python3 -c "import xdist" 2>/dev/null && xdist=(-n "${GPU_WORKERS:-4}")
  for part in "${parts[@]}"; do
    # shellcheck disable=SC2086
    timeout "${PART_TIMEOUT:-400}" python -m pytest -q -m gpu "${xdist[@]}" $part -rfEs \
      > "$out/pytest-$(echo $part | tr ' /' '__').log" 2>&1
    echo "pytest -m gpu $part: $(tail -1 "$out/pytest-$(echo $part | tr ' /' '__').log")" | tee -a "$out/summary.txt"
  done
fi
case "$what" in tests|tests-kernels|tests-other|tests-more) exit 0 ;; esac
if [[ "$what" =~ ^spec ]]; then  # speculative decoding on the V4.1 demo (issue 39's rows), 128 in / 256 out
  # spec / spec-equal: greedy equality in bf16 under batch invariance; spec / spec-oracle: off, fixed k = 5 and
  # varlen with oracle drafts at 0.8; spec / spec-dspark: the demo's own stages on its held-out Python source
  # (each part fits one device call; the spec GPU tests are `tests-other`'s)
  if [[ "$what" =~ ^spec(-equal)?$ ]]; then
    timeout 250 python benchmarks/spec_decode.py --model demo --ks 5 --oracle-rates 0.8 --methods oracle \
      --concurrency 1,16,64 --reps 1 --batch-invariant --out "$out/spec-equal.json" "${commit_arg[@]}" \
      > "$out/spec-equal.log" 2>&1
    echo "spec decode, batch-invariant bf16: $(tail -2 "$out/spec-equal.log" | head -1)" | tee -a "$out/summary.txt"
  fi
  if [[ "$what" =~ ^spec(-oracle)?$ ]]; then
    timeout 500 python benchmarks/spec_decode.py --model demo --ks 5 --oracle-rates 0.8 --methods oracle --varlen \
      --concurrency 1,4,16,64,128 --output-len 256 --reps 1 --out "$out/spec-oracle.json" "${commit_arg[@]}" \
      > "$out/spec-oracle.log" 2>&1
    echo "spec decode, oracle 0.8: $(tail -2 "$out/spec-oracle.log" | head -1)" | tee -a "$out/summary.txt"
  fi
  if [[ "$what" =~ ^spec(-dspark)?$ ]]; then
    timeout 400 python benchmarks/spec_decode.py --model demo --ks 5 --methods dspark --varlen \
      --prompt-tokens demo-heldout --concurrency 1,16 --output-len 256 --reps 1 --out "$out/spec-dspark.json" \
      "${commit_arg[@]}" > "$out/spec-dspark.log" 2>&1
    echo "spec decode, DSpark held-out: $(tail -2 "$out/spec-dspark.log" | head -1)" | tee -a "$out/summary.txt"
  fi
  exit 0
fi
if [ "$what" = probes ]; then
  (cd benchmarks && PYTHONPATH=.. timeout 300 python kernel_sweep.py --only decode-small \
     --out "$out/decode-small.json" "${commit_arg[@]}" > "$out/decode-small.log" 2>&1
   PYTHONPATH=.. timeout 200 python mma_rows_probe.py --out "$out/mma-rows.json" "${commit_arg[@]}" \
     > "$out/mma-rows.log" 2>&1; PYTHONPATH=.. timeout 150 python profile_step.py --phase decode --batch 1 \
     --gemm-shapes --rows 40 > "$out/profile-decode-b1.txt" 2>&1)
  echo "probes: $(tail -1 "$out/mma-rows.log")" | tee -a "$out/summary.txt"
  exit 0
fi
# the V4 demo (preset demo) and the V4.1 demo (demo41: Engram from the device history, CSA2 roles): 1000 with the
# switch on, and the control, 200 with it off (must give more than one distinct completion)
for preset in demo demo41; do
  timeout 280 python benchmarks/identical_completions.py --preset $preset --device cuda --dtype bfloat16 --num 1000 \
    --control-num 200 --modes both --out "$out/identical-completions-$preset.json" "${commit_arg[@]}" \
    > "$out/identical-completions-$preset.log" 2>&1
  echo "identical completions ($preset): $(tail -1 "$out/identical-completions-$preset.log")" \
    | tee -a "$out/summary.txt"
done

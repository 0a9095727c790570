#!/usr/bin/env bash
# The GPU checks of a device session in one call: every gpu-marked test (kernels first; a failure
# does not stop the rest), then the batch-invariance "1000 completions" run. Logs go to $1 (default benchmarks/results/gpu-checks);
# $2 picks a part (tests | identical | all, default all: together they can pass a 600 s call limit).
#   bash benchmarks/gpu_checks.sh "$OUT" tests
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu-checks}"
what="${2:-all}"
mkdir -p "$out"
export PYTHONPATH=. TORCHDYNAMO_DISABLE=1
commit=$(cd benchmarks && python3 -c "from common import git_commit; print(git_commit())")
echo "# commit $commit, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" | tee "$out/summary.txt"
[ "$what" = identical ] || for part in tests/kernels "tests/models tests/layers" tests/engine; do
  # shellcheck disable=SC2086
  timeout 400 python -m pytest -q -m gpu $part -rfE > "$out/pytest-$(echo $part | tr ' /' '__').log" 2>&1
  echo "pytest -m gpu $part: $(tail -1 "$out/pytest-$(echo $part | tr ' /' '__').log")" | tee -a "$out/summary.txt"
done
[ "$what" = tests ] && exit 0
timeout 300 python benchmarks/identical_completions.py --device cuda --dtype bfloat16 --num 1000 --modes on \
  --out "$out/identical-completions.json" > "$out/identical-completions.log" 2>&1
echo "identical completions: $(tail -2 "$out/identical-completions.log" | head -1)" | tee -a "$out/summary.txt"

#!/usr/bin/env bash
# The multi-GPU runs of issues 16 and 38, in one call on a machine with N >= 2 GPUs (default: all it has):
#   1. every gpu-marked test of tests/distributed (the 2-GPU NCCL cases skip below 2 GPUs; test_layouts.py's
#      TP=2, DP=2 + EP, DP=2 x TP=2 and CP=2 x TP=2 with DSpark, a JSON schema and prompt_logprobs against one
#      GPU, the 4-rank ones below 4 GPUs);
#   2. LLM.generate throughput, one process vs tensor_parallel_size=N vs data_parallel_size=N with
#      expert parallelism vs data_parallel_size=N/2 x tensor_parallel_size=2 (N >= 4), on the demo model, bf16,
#      the same prompts (benchmarks/offline_throughput.py);
#   3. start-up of a real checkpoint under DP + EP + EPLB when MODEL=<dir> is given (the fit check,
#      the weights / cache log, a few tokens);
#   4. V4-Flash at its released size (43 layers, 256 experts) in its shipped formats with random weights
#      (load_format dummy: config.json only, nothing written or read), DP = N + EP, LLM.generate output
#      tokens/s per GPU at concurrency 1, 64, 256 with SGLang's published workload (8K in, 1K out).
# Logs and JSON go to $1 (default benchmarks/results/multi-gpu). COMMIT=<hash> is recorded instead
# of git's answer (a copied tree's .git may be stale).
#   COMMIT=<hash> bash benchmarks/multi_gpu_checks.sh "$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/multi-gpu}"
mkdir -p "$out"
export PYTHONPATH=. TORCHDYNAMO_DISABLE=1
n=${GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
commit_arg=()
[ -n "${COMMIT:-}" ] && commit_arg=(--commit "$COMMIT")
echo "# $n GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$out/summary.txt"
timeout 900 python -m pytest -q -m gpu tests/distributed -rfEs > "$out/pytest-distributed.log" 2>&1
echo "pytest -m gpu tests/distributed: $(tail -1 "$out/pytest-distributed.log")" | tee -a "$out/summary.txt"
common=(--preset demo --device cuda --dtype bfloat16 --num-prompts 256 --input-len 256 --output-len 128
        --skip-transformers "${commit_arg[@]}")
layouts=("one:" "tp:--tensor-parallel-size $n" "dp-ep:--data-parallel-size $n --enable-expert-parallel")
[ "$n" -ge 4 ] && layouts+=("dp-tp:--data-parallel-size $((n / 2)) --tensor-parallel-size 2")
for layout in "${layouts[@]}"; do
  name=${layout%%:*}
  # shellcheck disable=SC2086
  timeout 900 python benchmarks/offline_throughput.py "${common[@]}" ${layout#*:} --out "$out/throughput-$name.json" \
    > "$out/throughput-$name.log" 2>&1
  echo "throughput ($name): $(grep -E '^deepinfer' "$out/throughput-$name.log" | head -1)" | tee -a "$out/summary.txt"
done
timeout 1500 python benchmarks/offline_throughput.py --preset flash --load-format dummy --device cuda --dtype bfloat16 \
  --data-parallel-size "$n" --enable-expert-parallel --concurrency 1,64,256 --input-len 8192 --output-len 1024 \
  "${commit_arg[@]}" --out "$out/flash-dummy-dp$n-ep.json" > "$out/flash-dummy-dp$n-ep.log" 2>&1
echo "V4-Flash released size, dummy weights, dp=$n + EP: $(grep -cE '^deepinfer' "$out/flash-dummy-dp$n-ep.log") rows" \
  | tee -a "$out/summary.txt"
if [ -n "${MODEL:-}" ]; then
  DEEPINFER_CONFIGURE_LOGGING=1 timeout 1800 deepinfer generate --model "$MODEL" --prompt "Hello" --max-tokens 8 \
    --temperature 0 -dp "$n" --enable-expert-parallel --enable-eplb > "$out/real-checkpoint.log" 2>&1
  echo "real checkpoint, dp=$n + EP + EPLB: exit $? ($(grep -c '"token_ids"' "$out/real-checkpoint.log") outputs)" \
    | tee -a "$out/summary.txt"
fi

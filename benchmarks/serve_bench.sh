#!/usr/bin/env bash
# `deepinfer bench serve` against `deepinfer serve` on the demo models (V4.1: `demo-random`; V4: the writer's
# demo preset), one server per model, at several concurrencies; a JSON per row in OUT.
#
#   COMMIT=<hash> bash benchmarks/serve_bench.sh OUT [MODELS] [CONCURRENCIES]
#   MODELS: v41,v4 (default)   CONCURRENCIES: 1,16,64 (default)
# Env: INPUT_LEN (1024), OUTPUT_LEN (128), PROMPTS_PER_SLOT (4; at least 16 prompts a row), PORT (8000),
#      SERVE_ARGS (extra `deepinfer serve` flags).
set -euo pipefail
OUT=${1:?usage: serve_bench.sh OUT [MODELS] [CONCURRENCIES]}
MODELS=${2:-v41,v4}
CONCS=${3:-1,16,64}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD)}
PORT=${PORT:-8000}
mkdir -p "$OUT"

server_pid=""
stop_server() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"; wait "$server_pid" || true
  fi
  server_pid=""
}
trap stop_server EXIT

for m in ${MODELS//,/ }; do
  case "$m" in
    v41) model=demo-random; tok=${DEEPINFER_CACHE:-$HOME/.cache/deepinfer}/demo-deepseek_v41 ;;
    v4) model=/tmp/deepinfer-demo-v4; tok=$model
        [[ -f "$model/config.json" ]] || python -m deepinfer.tools.make_checkpoint --preset demo --out "$model" ;;
    *) echo "unknown model $m (v41 or v4)" >&2; exit 2 ;;
  esac
  log="$OUT/serve-$m.log"
  python -m deepinfer.entrypoints.cli serve --model "$model" --port "$PORT" --served-model-name "$m" \
      ${SERVE_ARGS:-} >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { echo "server for $m exited:"; tail -30 "$log"; exit 1; }
    sleep 1
  done
  for c in ${CONCS//,/ }; do
    n=$(( c * ${PROMPTS_PER_SLOT:-4} )); (( n < 16 )) && n=16
    python -m deepinfer.entrypoints.bench_serve --port "$PORT" --model "$m" --tokenizer "$tok" \
        --dataset-name random --random-input-len "${INPUT_LEN:-1024}" --random-output-len "${OUTPUT_LEN:-128}" \
        --ignore-eos --num-prompts "$n" --max-concurrency "$c" --num-warmups "$c" --commit "$COMMIT" \
        --result-dir "$OUT" --result-filename "bench-serve-$m-c$c-$COMMIT.json"
  done
  stop_server
done

#!/usr/bin/env bash
# Serving benchmark of `tandem serve` with `tandem bench serve`, in one run:
#   random 256-in / 128-out prompts at concurrency 1, 8 and 32 (issue #3), and the shared-prefix
#   workload (issue #5). Results: benchmarks/results/serving/*.json (+ per-request records and plots).
# Usage: benchmarks/serving.sh [extra `tandem serve` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8765}
OUT=benchmarks/results/serving
mkdir -p "$OUT"
.venv/bin/tandem serve --port "$PORT" "$@" > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
common=(--base-url "http://127.0.0.1:$PORT" --ignore-eos --save-result --result-dir "$OUT" --num-warmups 2
        --goodput ttft:2000 tpot:150)
for c in 1 8 32; do
  n=$(( c == 1 ? 8 : c * 2 ))
  # A seed per run: with one seed each run would resend the previous run's prompts and the prefix
  # cache would hide their prefill.
  .venv/bin/tandem bench serve "${common[@]}" --dataset-name random --random-input-len 256 --seed "$c" \
      --random-output-len 128 --max-concurrency "$c" --num-prompts "$n" --label "random-c$c" \
      --result-filename "random-c$c.json" --plot
done
.venv/bin/tandem bench serve "${common[@]}" --dataset-name prefix_repetition --prefix-repetition-num-prefixes 4 \
    --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 --prefix-repetition-output-len 64 \
    --num-prompts 48 --request-rate 2 --label shared-prefix --result-filename shared-prefix.json --plot
.venv/bin/tandem bench compare "$OUT/random-c1.json" "$OUT/random-c8.json" "$OUT/random-c32.json"

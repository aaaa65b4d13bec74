#!/usr/bin/env bash
# `turbo serve` beside llama.cpp's `llama-server` on one GGUF and one ShareGPT-like workload, and
# beside `turbo generate --prompts-file` (the same requests without HTTP):
#   1. saturation: every request at once (`--rate inf`);
#   2. Poisson arrivals at 50% and 90% of each server's own saturation request rate (TTFT, ITL).
# The servers run one after the other on the same cores. Results: OUT/*.json and OUT/summary.txt.
#
#   benches/serve_compare.sh LLAMA_SERVER OUT [requests] [mean_in] [mean_out] [slots] [threads] [device]
#
# LLAMA_SERVER may be "-" to measure Turbo alone; device is Turbo's --device (default cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${1:?llama-server binary, or -}
OUT=${2:?output directory}
REQUESTS=${3:-64}
MEAN_IN=${4:-200}
MEAN_OUT=${5:-128}
SLOTS=${6:-32}
THREADS=${7:-$(nproc)}
DEVICE=${8:-cpu}
MODEL=${TURBO_MODEL:-$HOME/.cache/turbo/SmolLM2-135M-Instruct.Q4_1.gguf}
TURBO=${TURBO:-target/release/turbo}
mkdir -p "$OUT"
W=$OUT/workload.jsonl
python3 benches/sharegpt_like.py "$W" --requests "$REQUESTS" --mean-in "$MEAN_IN" --mean-out "$MEAN_OUT" --seed 0

wait_healthy() { # url pid
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server exited" >&2; return 1; }
    sleep 0.5
  done
  echo "the server did not become healthy" >&2
  return 1
}

sweep() { # name url
  local name=$1 url=$2
  "$TURBO" bench serve --url "$url" --prompts-file "$W" --requests "$REQUESTS" --rate inf \
    --json "$OUT/$name-inf.json" | tee "$OUT/$name-inf.txt"
  local sat
  sat=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['request_throughput'])" "$OUT/$name-inf.json")
  for pct in 50 90; do
    local rate
    rate=$(python3 -c "print(${sat} * ${pct} / 100)")
    "$TURBO" bench serve --url "$url" --prompts-file "$W" --requests "$REQUESTS" --rate "$rate" \
      --json "$OUT/$name-$pct.json" | tee "$OUT/$name-$pct.txt"
  done
}

# Offline: the same requests through the persistent batch, no HTTP.
"$TURBO" generate -m "$MODEL" --device "$DEVICE" --threads "$THREADS" --prompts-file "$W" \
  --ignore-eos --max-batch "$SLOTS" >"$OUT/generate.txt" 2>"$OUT/generate.err"
tail -n 5 "$OUT/generate.err"

"$TURBO" serve -m "$MODEL" --device "$DEVICE" --threads "$THREADS" --port 8311 --max-batch "$SLOTS" \
  --max-pending "$(( REQUESTS > 512 ? REQUESTS : 512 ))" \
  2>"$OUT/turbo-serve.log" &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
wait_healthy http://127.0.0.1:8311 $PID
sweep turbo http://127.0.0.1:8311
kill -INT $PID; wait $PID || true

if [ "$LLAMA_SERVER" != "-" ]; then
  # One slot per batch slot, each with room for the longest request (4x the means).
  CTX=$(( SLOTS * 4 * (MEAN_IN * 2 + MEAN_OUT) ))
  "$LLAMA_SERVER" -m "$MODEL" -t "$THREADS" -np "$SLOTS" -c "$CTX" --port 8312 -ngl 99 \
    >"$OUT/llama-server.log" 2>&1 &
  PID=$!
  wait_healthy http://127.0.0.1:8312 $PID
  sweep llama http://127.0.0.1:8312
  kill $PID; wait $PID || true
fi

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, os, re, sys
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
gen = open(os.path.join(out, "generate.err")).read() + open(os.path.join(out, "generate.txt")).read()
m = re.findall(r"([0-9.]+) output tok/s", gen)
print(f"turbo generate --prompts-file: {m[-1] if m else '?'} output tok/s")
for name in ("turbo", "llama"):
    for run in ("inf", "50", "90"):
        r = load(f"{name}-{run}")
        if not r:
            continue
        p = lambda k, q: (r.get(k) or {}).get(q, float("nan"))
        print(f"{name:6} rate {run:>3}: {r['completed']} ok {r['failed']} failed, "
              f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} out tok/s, "
              f"TTFT p50/p90/p99 {p('ttft_ms','p50'):.0f}/{p('ttft_ms','p90'):.0f}/{p('ttft_ms','p99'):.0f} ms, "
              f"ITL p50/p90/p99 {p('itl_ms','p50'):.1f}/{p('itl_ms','p90'):.1f}/{p('itl_ms','p99'):.1f} ms")
EOF

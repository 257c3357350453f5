#!/usr/bin/env bash
# AIPerf's multi-turn mode against `kvroute gateway` with three `kvroute engine`s, one run per
# router, the engines restarted cold for each (docs/BENCHMARKS.md, "A real client: AIPerf").
#
#   docs/aiperf/run.sh [KVROUTE] [OUT]      (defaults: target/release/kvroute, /tmp/aiperf-runs)
#
# Needs `aiperf` on PATH (`pip install aiperf==0.13.0`). Everything runs on loopback; the
# engines simulate H200s in real time (speedup 1), so the figures are wall-clock, as a user's.
# ROUTERS, CONVERSATIONS, CONCURRENCY, TURNS, INPUT_TOKENS, OUTPUT_TOKENS, TURN_DELAY_MS (mean
# pause between a reply and the next turn; its standard deviation is half of it) override the workload;
# GATEWAY_ARGS is added to the gateway's flags (e.g. "--kv-load-set learn_output_tokens=true"),
# and TAG to the run's name.
set -euo pipefail
KVROUTE=${1:-target/release/kvroute}
OUT=${2:-/tmp/aiperf-runs}
ROUTERS=${ROUTERS:-"round_robin kv_load"}
CONVERSATIONS=${CONVERSATIONS:-120}
CONCURRENCY=${CONCURRENCY:-30}
TURNS=${TURNS:-4}
INPUT_TOKENS=${INPUT_TOKENS:-1000}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-150}
TURN_DELAY_MS=${TURN_DELAY_MS:-0}
BASE_PORT=${BASE_PORT:-18100}
GATEWAY_ARGS=${GATEWAY_ARGS:-}
TAG=${TAG:-}
command -v aiperf >/dev/null || { echo "aiperf not found: pip install aiperf==0.13.0" >&2; exit 1; }
[ -x "$KVROUTE" ] || { echo "$KVROUTE not found: cargo build --release first" >&2; exit 1; }
mkdir -p "$OUT"

# AIPerf's `builtin` tokenizer is tiktoken's o200k_base, which tiktoken downloads on first use.
# Offline, seed tiktoken's cache (file named by the SHA-1 of the download URL) from the copy the
# tiktoken-rs crate ships in cargo's registry (kvroute's `text` crate depends on it).
if [ -z "${TIKTOKEN_CACHE_DIR:-}" ]; then
    export TIKTOKEN_CACHE_DIR="$OUT/tiktoken-cache"
    mkdir -p "$TIKTOKEN_CACHE_DIR"
    url=https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken
    key=$(printf %s "$url" | sha1sum | cut -d' ' -f1)
    if [ ! -f "$TIKTOKEN_CACHE_DIR/$key" ]; then
        src=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -name o200k_base.tiktoken 2>/dev/null | head -1)
        if [ -n "$src" ]; then cp "$src" "$TIKTOKEN_CACHE_DIR/$key"; fi
    fi
fi

pids=()
stop() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap stop EXIT

wait_ready() { # URL
    for _ in $(seq 1 100); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done
    echo "not ready: $1" >&2; return 1
}

for mode in $ROUTERS; do
    router=$mode$TAG
    workers=()
    for i in 1 2 3; do
        port=$((BASE_PORT + i))
        "$KVROUTE" engine --port "$port" --seed "$i" >"$OUT/engine-$router-$i.log" 2>&1 &
        pids+=($!)
        workers+=(--worker "http://127.0.0.1:$port")
    done
    for i in 1 2 3; do wait_ready "http://127.0.0.1:$((BASE_PORT + i))/health"; done
    "$KVROUTE" gateway --port "$BASE_PORT" --router-mode "$mode" "${workers[@]}" $GATEWAY_ARGS \
        >"$OUT/gateway-$router.log" 2>&1 &
    pids+=($!)
    wait_ready "http://127.0.0.1:$BASE_PORT/health"
    model=$(curl -sf "http://127.0.0.1:$BASE_PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    aiperf profile --model "$model" --url "http://127.0.0.1:$BASE_PORT" \
        --endpoint-type chat --streaming --tokenizer builtin \
        --conversation-num "$CONVERSATIONS" --conversation-turn-mean "$TURNS" \
        --conversation-turn-stddev 0 --concurrency "$CONCURRENCY" \
        --synthetic-input-tokens-mean "$INPUT_TOKENS" --synthetic-input-tokens-stddev 0 \
        --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 \
        --conversation-turn-delay-mean "$TURN_DELAY_MS" \
        --conversation-turn-delay-stddev "$((TURN_DELAY_MS / 2))" \
        --extra-inputs ignore_eos:true --random-seed 1 --ui-type none \
        --artifact-dir "$OUT/$router" >"$OUT/aiperf-$router.log" 2>&1
    curl -sf "http://127.0.0.1:$BASE_PORT/metrics" >"$OUT/gateway-$router.metrics" || true
    stop
    echo "$router: done ($OUT/$router)"
done

#!/usr/bin/env bash
# A two-turn conversation through the gateway at $1 for model $2: the second turn resends the
# first as its history, so the worker that served turn 1 holds most of turn 2's prompt in its
# KV cache. Passes when the gateway's dynamo_frontend_cached_tokens grew, and prints each
# turn's time to first token.
set -euo pipefail
url=$1 model=$2
cached() {
    curl -fsS "$url/metrics" | awk '/^dynamo_frontend_cached_tokens_sum/ {s += $2} END {print s + 0}'
}
# A long first message: enough blocks for the cache to matter.
context=$(for i in $(seq 120); do printf 'Paragraph %d: KV-cache-aware routing sends a conversation back to the worker that holds its history. ' "$i"; done)
turn() {
    curl -fsS -o /dev/null -w '%{time_starttransfer}' "$url/v1/chat/completions" \
        -H 'content-type: application/json' -d "$1"
}
before=$(cached)
one=$(printf '{"model": "%s", "max_tokens": 16, "stream": true, "messages": [{"role": "user", "content": "%s Summarise this."}]}' "$model" "$context")
two=$(printf '{"model": "%s", "max_tokens": 16, "stream": true, "messages": [{"role": "user", "content": "%s Summarise this."}, {"role": "assistant", "content": "It is about routing."}, {"role": "user", "content": "Why does that help?"}]}' "$model" "$context")
t1=$(turn "$one")
t2=$(turn "$two")
sleep 1
after=$(cached)
echo "turn 1 TTFT ${t1}s, turn 2 TTFT ${t2}s; cached prompt tokens: ${before} -> ${after}"
if awk -v a="$after" -v b="$before" 'BEGIN {exit !(a > b)}'; then
    echo "test-kv-cache: ok (turn 2 reused turn 1's KV cache)"
else
    echo "test-kv-cache: turn 2 found nothing cached" >&2
    exit 1
fi

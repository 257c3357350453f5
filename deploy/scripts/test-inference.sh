#!/usr/bin/env bash
# One chat completion through the gateway at $1 (http://127.0.0.1:PORT) for model $2: the
# gateway routes it to a worker and streams the answer back.
set -euo pipefail
url=$1 model=$2
body=$(printf '{"model": "%s", "max_tokens": 32, "messages": [{"role": "user", "content": "Say hello in five words."}]}' "$model")
answer=$(curl -fsS "$url/v1/chat/completions" -H 'content-type: application/json' -d "$body")
echo "$answer"
case "$answer" in
    *'"choices"'*) echo "test-inference: ok" ;;
    *) echo "test-inference: no choices in the answer" >&2; exit 1 ;;
esac

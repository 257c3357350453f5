#!/usr/bin/env bash
# Gateway replicas (docs/ROUTING.md, "Gateway replicas"): KV hit rate, TTFT, TOPS and the
# busiest worker's peak in-flight count for 1, 2 and 3 replicas, their sync at 5 ms, 50 ms and
# off, as a Markdown table.
# Usage: docs/replicas/table.sh KVROUTE WORKERS CONCURRENCY [more `kvroute sim` flags...]
set -euo pipefail
kvroute=$1 workers=$2 concurrency=$3
shift 3
settings=("1|" "2|--replica-sync-ms 5" "2|--replica-sync-ms 50" "2|--no-replica-sync"
  "3|--replica-sync-ms 5" "3|--replica-sync-ms 50" "3|--no-replica-sync")
echo "| replicas | sync | KV hit rate % | TTFT p50 ms | TTFT p95 ms | TOPS | busiest worker's peak in flight | busiest worker's mean in flight |"
echo "|:---:|:---:|:---:|:---:|:---:|:---:|:---:|:---:|"
for s in "${settings[@]}"; do
  n=${s%%|*} sync=${s#*|}
  # shellcheck disable=SC2086 # the sync flags are words
  "$kvroute" sim --workers "$workers" --concurrency "$concurrency" --gateway-replicas "$n" \
    $sync --json "$@" 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
r = d["runs"][0]
n, sync = sys.argv[1], sys.argv[2]
label = "-" if n == "1" else ("off" if "no-replica" in sync else sync.split()[-1] + " ms")
peaks = [w["peak_in_flight"] for w in r["per_worker"]]
means = [w["mean_in_flight"] for w in r["per_worker"]]
cells = [n, label, "%.1f" % (100 * r["kv_hit_rate"]), "%.0f" % r["ttft_ms"]["p50"],
         "%.0f" % r["ttft_ms"]["p95"], "%.0f" % r["output_tokens_per_s"], max(peaks),
         "%.1f" % max(means)]
print("| " + " | ".join(str(c) for c in cells) + " |")' "$n" "$sync"
done

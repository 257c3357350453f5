#!/usr/bin/env bash
# Hit rate and TTFT under each fault scenario next to the fault-free run, as a Markdown table
# (docs/RELIABILITY.md, "Seeded fault simulation").
# Usage: docs/fault-table.sh [KVROUTE] [SEED] [more `kvroute sim` flags...]
set -euo pipefail
kvroute=${1:-target/release/kvroute}
seed=${2:-1}
shift 2 || true
scenarios=(none worker-crash worker-hang slow-worker event-loss event-delay event-duplicate \
  event-reorder "worker-crash,worker-hang,slow-worker,event-loss,event-delay,event-duplicate,event-reorder")
echo "| faults | KV hit rate | TTFT p50 (ms) | TTFT p95 (ms) | finished | failed | routed again | resyncs | longest stale claim (s) |"
echo "|---|---|---|---|---|---|---|---|---|"
for f in "${scenarios[@]}"; do
  "$kvroute" sim --seed "$seed" --faults "$f" --json "$@" 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
r, t, f = d["summary"][0], d["totals"], d["faults"]
cells = ["`%s`" % f["spec"], "%.3f" % r["kv_hit_rate"], "%.0f" % r["ttft_ms"]["p50"],
         "%.0f" % r["ttft_ms"]["p95"], t["finished"], t["failed"], f["retried_requests"],
         f["kv_resyncs"], "%.3f" % f["max_stale_claim_s"]]
print("| " + " | ".join(str(c) for c in cells) + " |")'
done

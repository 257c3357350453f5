#!/usr/bin/env bash
# Hit rate and TTFT under each fault scenario next to the fault-free run, as a Markdown table
# (docs/RELIABILITY.md, "Seeded fault simulation").
# Usage: docs/fault-table.sh [KVROUTE] [SEED] [more `kvroute sim` flags...]
# (`--migration-limit 0 --ejection-time 0` among the flags: the gateway before migration.)
# With --gateway-replicas N (N ≥ 2) among the flags, the gateway replicas' scenarios
# (replica-restart, partition) and their columns instead.
set -euo pipefail
kvroute=${1:-target/release/kvroute}
seed=${2:-1}
shift 2 || true
replicas=0
for arg in "$@"; do
  [ "$arg" = --gateway-replicas ] && replicas=1
done
if [ "$replicas" = 1 ]; then
  scenarios=(none replica-restart partition=2 partition \
    "replica-restart,partition,worker-crash,event-loss,event-delay")
  echo "| faults | KV hit rate | TTFT p50 (ms) | TTFT p95 (ms) | finished | failed | of which lost with a replica | peer updates lost | KV events missed | peer snapshots applied | resyncs / filled from cache snapshots | longest stale claim (s) |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
else
  scenarios=(none worker-crash worker-hang slow-worker event-loss event-delay event-duplicate \
    event-reorder "worker-crash,worker-hang,slow-worker,event-loss,event-delay,event-duplicate,event-reorder")
  echo "| faults | KV hit rate | TTFT p50 (ms) | TTFT p95 (ms) | finished | failed | migrated (crash / stall) | routed again | resyncs / filled from cache snapshots | longest stale claim (s) |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
fi
for f in "${scenarios[@]}"; do
  "$kvroute" sim --seed "$seed" --faults "$f" --json "$@" 2>/dev/null | REPLICAS=$replicas python3 -c '
import json, os, sys
d = json.load(sys.stdin)
r, t, f = d["summary"][0], d["totals"], d["faults"]
cells = ["`%s`" % f["spec"], "%.3f" % r["kv_hit_rate"], "%.0f" % r["ttft_ms"]["p50"],
         "%.0f" % r["ttft_ms"]["p95"], t["finished"], t["failed"]]
if os.environ["REPLICAS"] == "1":
    cells += [f["gateway_failed_requests"], f["peer_updates_lost"], f["kv_events_missed"],
              f["snapshots_applied"]]
else:
    m = f["migrations"]
    cells += ["%d / %d" % (m["worker_failed"], m["worker_timeout"]), f["retried_requests"]]
cells += ["%d / %d" % (f["kv_resyncs"], f["kv_snapshots"]), "%.3f" % f["max_stale_claim_s"]]
print("| " + " | ".join(str(c) for c in cells) + " |")'
done

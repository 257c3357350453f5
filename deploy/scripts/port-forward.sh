#!/usr/bin/env bash
# Runs a command with a Service port-forwarded to 127.0.0.1:LOCAL, then stops the forward.
#   port-forward.sh NAMESPACE SERVICE LOCAL:REMOTE -- command ...
set -euo pipefail
ns=$1 svc=$2 ports=$3
shift 3
[ "${1:-}" = "--" ] && shift
kubectl -n "$ns" port-forward "svc/$svc" "$ports" >/dev/null 2>&1 &
pf=$!
trap 'kill $pf 2>/dev/null || true' EXIT
local_port=${ports%%:*}
for _ in $(seq 50); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$local_port") 2>/dev/null; then break; fi
    sleep 0.2
done
"$@"

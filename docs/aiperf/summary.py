#!/usr/bin/env python3
"""Prints one row per AIPerf run in DIR (docs/aiperf/run.sh's OUT): TTFT p50/p95/p99, ITL p50,
output tokens/s, requests/s, errors, and the gateway's prefix-cache hit rate (cached / prompt
tokens, from its /metrics after the run)."""
import json
import pathlib
import re
import sys

out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/aiperf-runs")


def metric_sum(text, name):
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{name}(\{{[^}}]*\}})? ", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


print("| run | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | ITL p50 ms | output tok/s | req/s | errors | hit rate |")
print("|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
for run in sorted(p for p in out.iterdir() if (p / "profile_export_aiperf.json").exists()):
    d = json.loads((run / "profile_export_aiperf.json").read_text())
    ttft, itl = d["time_to_first_token"], d["inter_token_latency"]
    errors = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    hit = "n/a"
    metrics = out / f"gateway-{run.name}.metrics"
    if metrics.exists():
        text = metrics.read_text()
        prompt = metric_sum(text, "dynamo_frontend_input_sequence_tokens_sum")
        cached = metric_sum(text, "dynamo_frontend_cached_tokens_sum")
        if prompt:
            hit = f"{100 * cached / prompt:.1f}%"
    print(
        f"| {run.name} | {ttft['p50']:.0f} | {ttft['p95']:.0f} | {ttft['p99']:.0f} | {itl['p50']:.1f} "
        f"| {d['output_token_throughput']['avg']:.0f} | {d['request_throughput']['avg']:.2f} | {errors} | {hit} |"
    )

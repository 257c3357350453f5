#!/usr/bin/env python3
"""Connection soak of the gateway (issue 20, item 5; results in docs/RELIABILITY.md).

Starts `kvroute engine` processes and one `kvroute gateway` in front of them on loopback, then
runs CYCLES cycles of: open CONNECTIONS client connections to the gateway at once, send one
chat request on each, read each answer, hold every connection open (idle keep-alive) until
all have been answered, then close them all. The gateway's open file descriptors
(/proc/PID/fd) and resident memory (VmRSS) are sampled every 0.1 s: before each cycle, at the
cycle's peak, while all connections are open, and after they closed. The gateway must
release what a cycle took: its descriptors after each cycle stay at their level after the
first (it keeps idle upstream connections to the engines pooled for 90 s) and are back to their
level before the first cycle once that idle timeout passed (--idle-wait), and its memory after
the last cycle stays within 10% (+8 MB) of its memory after the second (the first warms the
allocator and pools up).
The exit status is 1 when either does not hold.

Usage (a release build first: `cargo build --release -p kvroute`):

    python3 docs/soak-connections.py [--kvroute target/release/kvroute] [--connections 10000]
        [--cycles 5] [--engines 4] [--speedup 100] [--max-tokens 4] [-- GATEWAY FLAGS...]

Limits: every connection is a descriptor in this process and one in the gateway, so both need
a soft RLIMIT_NOFILE above CONNECTIONS. This script raises its own soft limit to the hard
limit (`ulimit -Hn`), and the processes it starts inherit it; if the hard limit is too low it
stops and says so. Each cycle connects from its own loopback address (127.0.0.10+cycle), so
the TIME_WAIT sockets a cycle leaves do not exhaust the next cycle's ports. Every step has a
deadline (connect and answer: 120 s per cycle), so the run is bounded in time.
"""

import argparse
import asyncio
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request

MODEL = "llama-3.1-70b-instruct"
# The first answer of each refusing status, printed at the end so a refusal says why.
first_refusals = {}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvroute", default="target/release/kvroute")
    p.add_argument("--connections", type=int, default=10_000)
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--speedup", type=float, default=100.0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--connect-concurrency", type=int, default=1000,
                   help="connections being set up at once (all stay open once set up)")
    p.add_argument("--idle-wait", type=float, default=95.0,
                   help="seconds to wait at the end for the gateway's idle upstream connections "
                        "(pooled 90 s) to close, then check its descriptors are back (0: skip)")
    p.add_argument("gateway_flags", nargs="*", help="extra `kvroute gateway` flags, after --")
    return p.parse_args()


def raise_fd_limit(needed):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        sys.exit(f"soak: {args.connections} connections need about {needed} open files per "
                 f"process, but the hard limit is {hard}: raise it (`ulimit -Hn {needed}` as "
                 f"root, or LimitNOFILE=) or pass a smaller --connections")
    target = needed if hard == resource.RLIM_INFINITY else hard
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard


def start(cmd, pattern):
    """Starts a process and waits (10 s at most) for the line naming its address."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            # Drain the rest of its output so it never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    sys.exit(f"soak: {' '.join(cmd)} did not start (no line matching {pattern!r})")


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def tcp_peers(pid, listen_port):
    """The gateway's TCP sockets by kind: (client connections, other connections, listeners).

    A client connection's local port is the gateway's; the others are its own connections to
    the engines (pooled while idle) and NATS/ZMQ."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    clients = others = listeners = 0
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[9] not in inodes:
                continue
            local_port = int(cols[1].rsplit(":", 1)[1], 16)
            if cols[3] == "0A":  # LISTEN
                listeners += 1
            elif local_port == listen_port:
                clients += 1
            else:
                others += 1
    return clients, others, listeners


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    """The gateway's descriptors and memory, every 0.1 s, with the peak since `reset`."""

    def __init__(self, pid):
        self.pid = pid
        self.reset()

    def reset(self):
        self.peak_fds, self.peak_rss = 0, 0.0

    def now(self):
        f, r = fds(self.pid), rss_mb(self.pid)
        self.peak_fds, self.peak_rss = max(self.peak_fds, f), max(self.peak_rss, r)
        return f, r

    async def run(self):
        while True:
            self.now()
            await asyncio.sleep(0.1)


async def one_connection(host, port, source, body, setup, all_answered, statuses):
    async with setup:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError as e:
            statuses[f"connect error ({e.strerror or e})"] = statuses.get(
                f"connect error ({e.strerror or e})", 0) + 1
            return None
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() +
                         b"\r\nContent-Type: application/json\r\nContent-Length: " +
                         str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1].decode()
            m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
            if m:
                answer = await reader.readexactly(int(m.group(1)))
                if status != "200" and status not in first_refusals:
                    first_refusals[status] = answer.decode(errors="replace")[:300]
            else:
                status += " (no length)"
            statuses[status] = statuses.get(status, 0) + 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            key = f"error ({type(e).__name__})"
            statuses[key] = statuses.get(key, 0) + 1
            writer.close()
            return None
    # Held open, idle, until every connection has its answer.
    await all_answered.wait()
    return writer


async def cycle(n, host, port, sampler, args):
    source = f"127.0.0.{10 + n}"
    body = json.dumps({
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Soak cycle {n}: one short answer, please."}],
        "max_tokens": args.max_tokens,
    }).encode()
    setup = asyncio.Semaphore(args.connect_concurrency)
    all_answered = asyncio.Event()
    statuses = {}
    before = sampler.now()
    sampler.reset()
    started = time.monotonic()
    tasks = [asyncio.create_task(one_connection(host, port, source, body, setup, all_answered,
                                                statuses))
             for _ in range(args.connections)]
    # Every connection answered (or failed), within the deadline.
    deadline = started + 120
    while sum(statuses.values()) < args.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    answered_s = time.monotonic() - started
    await asyncio.sleep(0.3)
    open_now = sampler.now()
    sockets_open = tcp_peers(sampler.pid, port)
    all_answered.set()
    writers = [w for w in await asyncio.gather(*tasks) if w is not None]
    for w in writers:
        w.close()
    await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
    peak = (sampler.peak_fds, sampler.peak_rss)
    # The gateway closes its side once it reads each client's FIN.
    settle_deadline = time.monotonic() + 10
    while fds(sampler.pid) > before[0] + 4 and time.monotonic() < settle_deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    after = sampler.now()
    sockets_after = tcp_peers(sampler.pid, port)
    return {
        "sockets_after": sockets_after,
        "cycle": n + 1,
        "answered_s": answered_s,
        "held": len(writers),
        "statuses": dict(sorted(statuses.items())),
        "before": before,
        "peak": peak,
        "open": open_now,
        "sockets_open": sockets_open,
        "after": after,
    }


async def main(args):
    needed = args.connections + 1024
    soft_before, soft, hard = raise_fd_limit(needed)
    print(f"open files: soft limit {soft_before} raised to {soft} (hard {hard}); "
          f"{args.connections} connections x {args.cycles} cycles, {args.engines} engines")
    procs = []
    try:
        urls = []
        for i in range(args.engines):
            proc, url = start([args.kvroute, "engine", "--port", "0", "--speedup",
                               str(args.speedup), "--worker-id", str(i + 1)],
                              r"listening on (http://\S+)")
            procs.append(proc)
            urls.append(url)
        cmd = [args.kvroute, "gateway", "--port", "0"]
        for url in urls:
            cmd += ["--worker", url]
        proc, gw = start(cmd + args.gateway_flags, r"listening on (http://\S+)")
        procs.append(proc)
        host, port = gw.removeprefix("http://").rsplit(":", 1)
        port = int(port)
        # The gateway learns the workers' block size before it serves.
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"{gw}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        sampler = Sampler(proc.pid)
        sampling = asyncio.create_task(sampler.run())
        results = []
        for n in range(args.cycles):
            results.append(await cycle(n, host, port, sampler, args))
            r = results[-1]
            print(f"cycle {r['cycle']}: answered in {r['answered_s']:.1f} s, {r['held']} held "
                  f"open, {r['statuses']}", flush=True)
        sampling.cancel()
        idle = None
        if args.idle_wait > 0:
            print(f"waiting {args.idle_wait:.0f} s for idle upstream connections to close", flush=True)
            await asyncio.sleep(args.idle_wait)
            idle = (fds(proc.pid), rss_mb(proc.pid))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    print()
    print("| cycle | answered in (s) | answers | fds before | fds peak | fds all open (client / "
          "upstream conns) | fds after (client / upstream conns) | RSS before (MB) | RSS peak "
          "| RSS all open | RSS after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        answers = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
        so, sa = r["sockets_open"], r["sockets_after"]
        print(f"| {r['cycle']} | {r['answered_s']:.1f} | {answers} | {r['before'][0]} | "
              f"{r['peak'][0]} | {r['open'][0]} ({so[0]} / {so[1]}) | {r['after'][0]} "
              f"({sa[0]} / {sa[1]}) | {r['before'][1]:.0f} | {r['peak'][1]:.0f} | "
              f"{r['open'][1]:.0f} | {r['after'][1]:.0f} |")
    # After a cycle the gateway keeps idle upstream connections to the engines (reqwest's
    # pool: at most 4,096 per worker, closed after 90 s idle; how many depends on the cycle's
    # peak concurrency). What must hold: no client connection left, and every other descriptor
    # is the level before the first cycle plus those pooled connections; once the pool's idle
    # timeout has passed, the level before the first cycle itself.
    start_fds = results[0]["before"][0]
    leaked = [r["cycle"] for r in results
              if r["sockets_after"][0] != 0 or r["after"][0] - r["sockets_after"][1] > start_fds + 4]
    # The first cycle warms the allocator's arenas and the pools up (its "after" is read while
    # memory is still being returned), so memory is compared from the second cycle on.
    reference = results[1] if len(results) > 2 else results[0]
    first_rss, last_rss = reference["after"][1], results[-1]["after"][1]
    grew = last_rss > first_rss * 1.10 + 8
    print()
    print(f"descriptors after each cycle, less pooled upstream connections, vs before the first "
          f"({start_fds}); client connections left: "
          + ("held, none" if not leaked else f"GREW after cycles {leaked}"))
    print(f"memory after the last cycle {last_rss:.0f} MB vs after cycle {reference['cycle']} "
          f"{first_rss:.0f} MB: "
          + ("held" if not grew else "GREW"))
    if idle is not None:
        drained = idle[0] <= start_fds + 4
        print(f"after {args.idle_wait:.0f} s idle: {idle[0]} descriptors (before the first cycle: "
              f"{start_fds}: " + ("back" if drained else "NOT back") + f"), {idle[1]:.0f} MB")
        leaked = leaked or not drained
    for status, body in sorted(first_refusals.items()):
        print(f"first {status} answer: {body}")
    return 1 if leaked or grew else 0


if __name__ == "__main__":
    args = parse_args()
    sys.exit(asyncio.run(main(args)))

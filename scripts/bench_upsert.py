#!/usr/bin/env python
"""Mooncake-parity write paths: upsert against put, and copy-task latency.

One master subprocess and two Mooncake-compatible stores in this process
(each contributing memory; same host, so bytes move through shared memory):

- single 4 KiB writes: ``put`` of new keys, ``upsert`` replacing a key of the
  same size, ``upsert`` alternating two sizes (p50/p99 in microseconds);
- ``put_batch`` of new keys against ``upsert_batch`` over existing ones
  (32 keys x 64 KiB; GB/s over the run);
- ``create_copy_task`` onto the other store's segment until ``query_task``
  says SUCCESS (p50/p99 in ms: the task reaches the source owner through its
  held PING, docs/tier.md; before the long poll it waited for the owner's
  next ping, ``ping_interval_s`` = 1 s by default).

    .venv/bin/python scripts/bench_upsert.py [--json out/bench_upsert.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any

from kvpool.cluster.processes import MasterProcess
from kvpool.store.mooncake import MooncakeDistributedStore, ReplicateConfig, TaskStatus

log = logging.getLogger("bench_upsert")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        assert fn(i) == 0
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default="")
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    records: list[dict[str, Any]] = []
    with MasterProcess() as m:
        a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
        for s in (a, b):
            assert s.setup("localhost", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "",
                           m.address) == 0
        try:
            small, other = os.urandom(4096), os.urandom(6144)
            n = args.n
            runs = {
                "put 4KiB (new keys)": lambda i: a.put(f"p{i}", small),
                "upsert 4KiB (same size)": lambda i: a.upsert("u", small),
                "upsert 4KiB/6KiB (size changes)":
                    lambda i: a.upsert("v", small if i % 2 else other),
            }
            for name, fn in runs.items():
                lat = timed(fn, n)
                records.append({"op": name, "n": n, "p50_us": pct(lat, 0.5) * 1e6,
                                "p99_us": pct(lat, 0.99) * 1e6})
            keys = [f"b{i}" for i in range(32)]
            vals = [os.urandom(64 << 10) for _ in keys]
            rounds = 50
            t = time.perf_counter()
            for r in range(rounds):
                assert a.put_batch([f"{k}-{r}" for k in keys], vals) == 0
            put_s = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(rounds):
                assert a.upsert_batch(keys, vals) == 0
            ups_s = time.perf_counter() - t
            nbytes = rounds * 32 * (64 << 10)
            records.append({"op": "put_batch 32x64KiB", "gbps": nbytes / put_s / 1e9})
            records.append({"op": "upsert_batch 32x64KiB", "gbps": nbytes / ups_s / 1e9})
            cfg = ReplicateConfig()
            cfg.preferred_segment = a.get_hostname()
            lat = []
            for i in range(20):
                assert a.put(f"c{i}", small, cfg) == 0
                t = time.perf_counter()
                tid, err = a.create_copy_task(f"c{i}", [b.get_hostname()])
                assert err == 0
                while True:
                    resp, err = a.query_task(tid)
                    assert err == 0 and resp is not None
                    if resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
                        assert resp.status == TaskStatus.SUCCESS
                        break
                    time.sleep(0.005)
                lat.append(time.perf_counter() - t)
            records.append({"op": "copy task 4KiB to SUCCESS", "n": 20,
                            "p50_ms": statistics.median(lat) * 1e3,
                            "p99_ms": max(lat) * 1e3})
        finally:
            a.remove_all(True)
            a.close()
            b.close()
    for r in records:
        print(json.dumps(r))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

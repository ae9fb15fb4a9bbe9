#!/usr/bin/env python
"""kvpool as a secondary tier of vLLM's native offloading: how fast chunks go
through it, and how long vLLM's scheduler thread is held meanwhile.

A master and a node daemon on this host hold the pool. Engine A's vLLM
offloading manager (vLLM's TieringOffloadingSpec, its CPU tier in shared
memory, the tier loaded by module_path) stores ``--chunks`` chunks of
``--row-kib`` KiB, ``--job`` chunks per request (timed from the first
``complete_store``, when vLLM's GPU -> CPU copies are done, until the pool has
them); engine B, sharing the pool, looks the chunks up as one request and
steps until every one is promoted into its CPU tier (bytes checked). The
baseline is the store client alone moving the same rows with the same
batches (``batch_put_from`` / one ``batch_get_into``, a fresh client each, as
each engine's tier is). Per round:
store/load MiB/s of each, and the scheduler-thread time (all of it, and the
longest single manager call) of the tier's runs. Needs the vllm extra.

    .venv/bin/python scripts/bench_offload_tier.py --json out/bench_offload_tier.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test support
from support.offload_tier import Engine

_MIB = 1 << 20


def _round(args: argparse.Namespace, master: str, r: int) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult, make_offload_key

    from kvpool.store import Client, ClientConfig

    row = args.row_kib * 1024
    n = args.chunks
    mib = n * row / _MIB
    rng = np.random.default_rng(r)
    data = [rng.integers(0, 256, row, dtype=np.uint8) for _ in range(n)]
    keys = [make_offload_key(f"bench-{r}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]
    prefix = f"bench-{r}"
    a = Engine(master, row=row, chunks=n, step_s=args.step_ms / 1000, prefix=prefix,
               max_inflight_mib=4 * mib)
    b = Engine(master, row=row, chunks=n, step_s=args.step_ms / 1000, prefix=prefix)
    try:
        jobs = [(a.prepare_store(f"s{j}", keys[j:j + args.job], data[j:j + args.job]),
                 keys[j:j + args.job]) for j in range(0, n, args.job)]
        t0 = time.perf_counter()
        for ctx, ks in jobs:
            a.complete_store(ctx, ks)
        a.settle(timeout_s=120)
        store_s = time.perf_counter() - t0
        assert a.tier.stats.store_failures == 0 and a.tier.stats.stores_dropped == 0

        ctx = b.ctx("load")
        b.manager.on_new_request(ctx)
        t0 = time.perf_counter()
        b.lookup(ctx, keys, timeout_s=120, until=lambda _: b.tier.stats.lookup_calls > 0)
        lookup_s = time.perf_counter() - t0
        res = b.lookup(ctx, keys, timeout_s=120)
        load_s = time.perf_counter() - t0
        assert res == [LookupResult.HIT] * n, res
        assert b.read(ctx, keys) == [d.tobytes() for d in data]
        b.manager.on_request_finished(ctx)

        names = [a.tier.key_name(k) for k in keys]
        raw = [f"raw-{name}" for name in names]
        # a fresh client each way, as each engine's tier has (its first reads
        # and writes of pool pages map them into the process)
        with Client(ClientConfig(master_address=master)) as c:
            t0 = time.perf_counter()
            for j in range(0, n, args.job):
                codes = c.batch_put_from(raw[j:j + args.job], data[j:j + args.job])
                assert all(code == 0 for code in codes), codes
            raw_store_s = time.perf_counter() - t0
        with Client(ClientConfig(master_address=master)) as c:
            into = [np.ones(row, np.uint8) for _ in range(n)]  # (touched, as the CPU tier's)
            t0 = time.perf_counter()
            got = c.batch_get_into(raw, into)
            raw_load_s = time.perf_counter() - t0
            assert got == [row] * n
            c.batch_remove(names + raw, force=True)
        return {
            "tier_store_mib_s": mib / store_s, "raw_store_mib_s": mib / raw_store_s,
            "tier_load_mib_s": mib / load_s, "raw_load_mib_s": mib / raw_load_s,
            "store_sched_ms": a.sched_s * 1000, "store_max_call_ms": a.max_call_s * 1000,
            "load_sched_ms": b.sched_s * 1000, "load_max_call_ms": b.max_call_s * 1000,
            "load_lookup_calls": b.tier.stats.lookup_calls, "lookup_ms": lookup_s * 1000,
            "load_ms": load_s * 1000, "raw_load_ms": raw_load_s * 1000,
        }
    finally:
        a.close()
        b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--chunks", type=int, default=64, help="chunks stored and loaded per round")
    ap.add_argument("--row-kib", type=int, default=512, help="KiB per chunk (a multiple of 4)")
    ap.add_argument("--job", type=int, default=8, help="chunks per stored request")
    ap.add_argument("--step-ms", type=float, default=1.0, help="time between scheduler steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    # every round's chunks stay held a while after their removal (read leases
    # of the lookups and reads): room for all of them, so nothing is evicted
    pool_mib = (2 * args.rounds + 1) * args.chunks * args.row_kib // 1024 + 64
    rounds = []
    with MasterProcess() as m, NodeDaemonProcess(m.address, memory=f"{pool_mib}MiB"):
        for r in range(args.rounds):
            rounds.append(_round(args, m.address, r))
            print(json.dumps(rounds[-1]), file=sys.stderr)
    summary = {k: statistics.median(rd[k] for rd in rounds) for k in rounds[0]}
    out = {"args": vars(args), "median": summary, "rounds": rounds}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

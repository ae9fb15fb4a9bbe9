#!/usr/bin/env python
"""Benchmark the master: batched metadata ops/s, RSS per object, snapshot pause.

Runs a real ``kvpool master`` subprocess (with a data dir: journal on, fsync
``interval``) and drives it over loopback TCP with MasterClient.

Targets (printed under "targets"): batched put >= 250k key-ops per master
CPU-second with capabilities on; RSS <= 400 B per object at 1M objects.

- ops/s at batch 1 and 128 for put (put_start + put_end = 2 key-ops per
  object), get_replica_list and exist. Reported per wall second and per
  second of master CPU time (``master_cpu_key_ops_per_s``: what one core of
  master achieves; the client shares this 2-core box).
- RSS bytes per object: master RSS growth / objects after filling
  ``--objects`` (default 1M) objects with 40-char keys, one replica each.
- snapshot pause: a (fuzzy, incremental) snapshot of those objects is taken
  (SIGUSR1) while a pinger measures PING latency; reports the loop pause to
  start it (wall and CPU: the key-list copy), the longest serialization slice,
  and the worst PING latency seen during vs. before the snapshot. Wall-clock
  numbers are only meaningful on an idle box (the 1-min load is recorded).
- ``python_loop_us`` (start, end): a fixed pure-Python loop timed beside the
  run (scripts/bench_host.py): per-CPU-second numbers of different days
  compare through it (this VM's speed varies up to ~2x).

- ``--tenants N``: the master is configured with N tenants (quotas far above
  what the run stores) and every op runs for 2 x ``--seconds`` without
  tenants and as long with its batches spread over the N tenants (each
  request names one, round robin), in ``--tenant-slices`` slices per mode
  that alternate 0, N, N, 0, 0, N, ... (the machines here change speed
  within seconds: a drift weighs on both modes alike); the master's CPU is
  read at ns resolution (the scheduler's per-thread run time).
  ``tenants_cost`` reports, per op and batch, the key-ops per master
  CPU-second with tenants over without: the median over slices of the
  ratio of each slice's two back-to-back runs (the target: within 5%,
  docs/tenants.md).

- restart: the master is killed and started again on its data dir (the
  snapshot just taken): seconds until it answers (it serves while the
  snapshot's objects are made: kvpool.master.unloaded), objects restored per
  second until then, then BatchExist x128 of random filled keys back to back
  until every object is made: their latencies while loading, and seconds
  from the kill until all were loaded (restore speed in the one load path:
  scripts/bench_limits.py restore).

Usage: scripts/bench_master.py --json OUT [--objects 1000000] [--seconds 2]
Profiling: scripts/bench_master.py --quick --batches 128 --ops put --seconds 20
Tenants' cost: scripts/bench_master.py --quick --tenants 4 --batches 128 --seconds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
from bench_host import python_loop_us

from kvpool.cluster.processes import MasterProcess
from kvpool.core.protocol import (
    BatchExist,
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutStart,
    Exist,
    GetReplicaList,
    MountSegment,
    Ping,
    PutEnd,
    PutStart,
    RemoveAll,
    SegmentDescriptor,
    SegmentKind,
    Stats,
)
from kvpool.core.rpc_client import MasterClient

TARGETS = {"key_ops_per_s": 250_000, "rss_bytes_per_object": 400, "snapshot_pause_ms": 20}


def key(prefix: str, i: int) -> str:
    return f"{prefix}-{i:012d}-{(i * 2654435761) & 0xFFFFFFFF:08x}-kvpool-b"[:40]


class Meter:
    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)

    def cpu(self) -> float:
        """The process's CPU seconds: the sum of its threads' run time from
        /proc (ns; ``cpu_times`` counts 10 ms ticks), ``cpu_times`` elsewhere."""
        try:
            total = 0
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            return total / 1e9
        except (OSError, ValueError, IndexError):
            t = self.proc.cpu_times()
            return t.user + t.system

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)


def run_phase(c: MasterClient, meter: Meter, name: str, batch: int, seconds: float,
              prefix: str, counter: list[int], tenants: int = 0) -> dict[str, Any]:
    """Run one op kind for ``seconds``; return rates. ``tenants`` > 0: request
    ``i`` acts for tenant ``t{i % tenants}`` (its keys are in that tenant's
    namespace; a read phase reads them back in the same tenants)."""
    n_keys = 0
    nreq = 0
    key_ops = 0
    t0 = time.perf_counter()
    cpu0 = meter.cpu()
    lat: list[float] = []
    while time.perf_counter() - t0 < seconds:
        start = counter[0]
        keys = [key(prefix, start + j) for j in range(batch)]
        t1 = time.perf_counter()
        if name == "put":
            # the tenant of a batch follows from its first key's number
            tenant = f"t{(start // batch) % tenants}" if tenants else ""
            counter[0] += batch
            if batch == 1:
                c.call(PutStart(client_id="bench", key=keys[0], size=4096, tenant=tenant))
                c.call(PutEnd(client_id="bench", key=keys[0], tenant=tenant))
            else:
                c.call(BatchPutStart("bench", keys, [4096] * batch, tenant=tenant))
                c.call(BatchPutEnd(client_id="bench", keys=keys, tenant=tenant))
            key_ops += 2 * batch
        else:
            # read keys that exist: cycle over what the put phase wrote (whole batches)
            base = (counter[1] * batch) % max(counter[0] - batch, 1) // batch * batch
            counter[1] += 1
            tenant = f"t{(base // batch) % tenants}" if tenants else ""
            keys = [key(prefix, base + j) for j in range(batch)]
            if batch == 1:
                c.call(GetReplicaList(keys[0], tenant=tenant) if name == "get_replica_list"
                       else Exist(keys[0], tenant=tenant))
            else:
                c.call(BatchGetReplicaList(keys, tenant=tenant) if name == "get_replica_list"
                       else BatchExist(keys, tenant=tenant))
            key_ops += batch
        nreq += 1
        lat.append(time.perf_counter() - t1)
        n_keys += batch
    wall = time.perf_counter() - t0
    cpu = meter.cpu() - cpu0
    return {
        "op": name, "batch": batch, "tenants": tenants, "keys": n_keys, "key_ops": key_ops,
        "wall_s": round(wall, 3), "master_cpu_s": round(cpu, 6),
        "key_ops_per_s": round(key_ops / wall),
        "master_cpu_key_ops_per_s": round(key_ops / cpu) if cpu > 0 else None,
        "rpc_p50_us": round(statistics.median(lat) * 1e6, 1),
    }


def fill(c: MasterClient, n: int, prefix: str, batch: int = 2048) -> float:
    t0 = time.perf_counter()
    for base in range(0, n, batch):
        keys = [key(prefix, i) for i in range(base, min(n, base + batch))]
        r = c.call(BatchPutStart("bench", keys, [4096] * len(keys)), timeout_s=60)
        bad = [(k, code) for k, code in zip(keys, r.codes, strict=True) if code]
        if bad:
            raise SystemExit(f"fill failed: {bad[:3]}")
        c.call(BatchPutEnd(client_id="bench", keys=keys), timeout_s=60)
    return time.perf_counter() - t0


def while_loading(c: MasterClient, n: int, t0: float) -> dict[str, Any]:
    """A restarted master serving while it loads its snapshot's objects:
    BatchExist of 128 random filled keys back to back (each must find all)
    until STATS says every object is made; their latencies, and when that
    was (seconds after ``t0``, the kill)."""
    rng = random.Random(5)
    lat: list[float] = []
    while True:
        keys = [key("obj", rng.randrange(n)) for _ in range(128)]
        t = time.perf_counter()
        r = c.call(BatchExist(keys), timeout_s=60)
        lat.append(time.perf_counter() - t)
        if not all(r.exists):
            raise SystemExit("a restarted master lost objects: "
                             f"{[k for k, e in zip(keys, r.exists, strict=True) if not e][:3]}")
        if len(lat) % 8 == 0 and not c.call(Stats()).restore_unloaded:
            break
    loaded = time.perf_counter() - t0
    lat.sort()
    return {"restart_loaded_s": round(loaded, 2), "exist_calls_while_loading": len(lat),
            "exist_p50_ms_while_loading": round(lat[len(lat) // 2] * 1e3, 2),
            "exist_p99_ms_while_loading": round(lat[min(len(lat) - 1, len(lat) * 99 // 100)]
                                                * 1e3, 2),
            "exist_max_ms_while_loading": round(lat[-1] * 1e3, 2)}


def snapshot_pause(m: MasterProcess, c: MasterClient) -> dict[str, Any]:
    lat: list[float] = []
    stop = threading.Event()

    def pinger() -> None:
        with MasterClient(m.address, timeout_s=30) as pc:
            while not stop.is_set():
                t = time.perf_counter()
                pc.call(Ping(client_id="bench"))
                lat.append(time.perf_counter() - t)
                time.sleep(0.001)

    th = threading.Thread(target=pinger, daemon=True)
    th.start()
    time.sleep(0.3)
    base = len(lat)
    snaps0 = c.call(Stats()).snapshots
    assert m.pid is not None
    os.kill(m.pid, signal.SIGUSR1)
    t0 = time.perf_counter()
    while True:
        st = c.call(Stats(), timeout_s=30)
        if st.snapshots > snaps0 or time.perf_counter() - t0 > 300:
            break
        time.sleep(0.05)
    during = lat[base:]
    stop.set()
    th.join(10)
    before = sorted(lat[:base]) or [0.0]
    return {
        "start_pause_ms": round(st.last_snapshot_pause_ms, 2),
        "start_pause_cpu_ms": round(st.last_snapshot_pause_cpu_ms, 2),
        "max_step_ms": round(st.max_snapshot_step_ms, 2),
        "max_step_cpu_ms": round(st.max_snapshot_step_cpu_ms, 2),
        "loadavg": round(st.loadavg, 2),
        "snapshot_duration_s": round(st.last_snapshot_duration_s, 2),
        "pings_during": len(during),
        "ping_max_ms_during": round(max(during) * 1000, 2) if during else None,
        "ping_p50_ms_before": round(before[len(before) // 2] * 1000, 3),
        "ping_max_ms_before": round(before[-1] * 1000, 2),
    }


def cost_phases(c: MasterClient, meter: Meter, op_names: list[str], batch: int,
                seconds: float, tenants: int, slices: int) -> list[dict[str, Any]]:
    """Each op for 2 x ``seconds`` without tenants and as long over
    ``tenants`` tenants, in ``slices`` slices per mode alternating 0, N, N,
    0, ... (each mode's reads read back the keys its own puts wrote)."""
    counters = {0: [0, 0], tenants: [0, 0]}
    out = []
    for name in op_names:
        for sl in range(slices):
            for mode in ((0, tenants) if sl % 2 == 0 else (tenants, 0)):
                r = run_phase(c, meter, name, batch, 2 * seconds / slices,
                              f"b{batch}m{mode}", counters[mode], mode)
                r["slice"] = sl
                out.append(r)
        rates = []
        for mode in (0, tenants):
            got = [p for p in out if p["op"] == name and p["tenants"] == mode]
            cpu = sum(p["master_cpu_s"] for p in got)
            rates.append(f"tenants {mode} {sum(p['key_ops'] for p in got) / cpu:,.0f}")
        print(f"{name:17s} batch {batch:4d}: {', '.join(rates)} key-ops per master-CPU-s",
              file=sys.stderr)
    return out


def tenants_cost(phases: list[dict[str, Any]], tenants: int) -> list[dict[str, Any]]:
    """Per op and batch: key-ops per master CPU-second with ``tenants``
    tenants over without. ``ratio``: the median over slices of the ratio of
    the two modes' runs of that slice (back to back: the box's drift and a
    master-wide stall, such as a shard's table growing, weigh on one pair,
    not on a mode's total); ``ratio_totals``: total key-ops over total CPU
    of each mode's runs."""
    out = []
    for op, batch in dict.fromkeys((p["op"], p["batch"]) for p in phases):
        runs = [p for p in phases if (p["op"], p["batch"]) == (op, batch)]
        rate = {}
        for mode in (0, tenants):
            mine = [p for p in runs if p["tenants"] == mode]
            cpu = sum(p["master_cpu_s"] for p in mine)
            rate[mode] = sum(p["key_ops"] for p in mine) / cpu if cpu > 0 else 0.0
        pairs: dict[int, dict[int, float]] = {}
        for p in runs:
            if p["master_cpu_s"] > 0:
                pairs.setdefault(p["slice"], {})[p["tenants"]] = p["key_ops"] / p["master_cpu_s"]
        per_slice = [r[tenants] / r[0] for r in pairs.values() if len(r) == 2 and r[0]]
        out.append({"op": op, "batch": batch, "no_tenants": round(rate[0]),
                    "tenants": round(rate[tenants]),
                    "ratio": round(statistics.median(per_slice), 4) if per_slice else None,
                    "ratio_totals": round(rate[tenants] / rate[0], 4) if rate[0] else None,
                    "slice_ratios": [round(r, 3) for r in per_slice]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--objects", type=int, default=1_000_000, help="objects for RSS/snapshot")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per ops/s phase")
    ap.add_argument("--fsync", default="interval", help="journal fsync policy")
    ap.add_argument("--batches", default="1,128",
                    help="batch sizes of the ops/s phases (comma-separated)")
    ap.add_argument("--ops", default="put,get_replica_list,exist",
                    help="ops of the ops/s phases (comma-separated; reads need a put first)")
    ap.add_argument("--rpc-spin-us", type=int, default=0,
                    help="the master's reply poll after each answer (rpc_spin_us; its default "
                    "is 200): off here, as it fills the gap before this one client's next "
                    "request with polling CPU that a master with requests waiting never spends")
    ap.add_argument("--tenants", type=int, default=0,
                    help="also run every ops/s phase with its requests spread over this many "
                    "tenants (interleaved with runs without, twice each); reports the ratio")
    ap.add_argument("--tenant-slices", type=int, default=8,
                    help="with --tenants: the slices each mode's 2 x --seconds is cut into, "
                    "alternating with the other mode's")
    ap.add_argument("--quick", action="store_true",
                    help="ops/s phases only (no RSS fill, snapshot or restart): for profiling")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    op_names = args.ops.split(",")

    results: dict[str, Any] = {"targets": TARGETS, "objects": args.objects,
                               "key_length": 40, "cpus": os.cpu_count(),
                               "python_loop_us_start": python_loop_us()}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-master-") as data:
        extra = ["--snapshot-interval-s", "0", "--journal-fsync", args.fsync,
                 "--rpc-spin-us", str(args.rpc_spin_us)]
        if args.tenants:  # quotas far above what the run stores: the accounting's cost only
            cfg_path = os.path.join(data, "tenants.yaml")
            with open(cfg_path, "w") as f:
                f.write("tenants:\n" + "".join(f"  t{i}: {{memory: 1PiB, disk: 1PiB}}\n"
                                                for i in range(args.tenants)))
            extra += ["--config", cfg_path]
        with MasterProcess(data_dir=os.path.join(data, "d"), client_ttl_s=3600,
                           start_timeout_s=300, extra_args=extra) as m, \
                MasterClient(m.address, timeout_s=30) as c:
            assert m.pid is not None
            meter = Meter(m.pid)
            print(f"master pid {m.pid}", file=sys.stderr, flush=True)
            for i in range(4):  # 4 x 64 TiB: capacity never limits the benchmark
                c.call(MountSegment(client_id="bench",
                       segment=SegmentDescriptor(f"bench-seg-{i}", "bench", "host-bench",
                                                 SegmentKind.MEMORY, 64 << 40,
                                                 f"kvpool-bench-seg-{i}")))
            phases = []
            for batch in batches:
                if args.tenants:
                    phases += cost_phases(c, meter, op_names, batch, args.seconds,
                                          args.tenants, args.tenant_slices)
                    continue
                counter = [0, 0]
                for name in op_names:
                    r = run_phase(c, meter, name, batch, args.seconds, f"b{batch}", counter)
                    phases.append(r)
                    print(f"{name:17s} batch {batch:4d}: "
                          f"{r['key_ops_per_s']:>9,} key-ops/s wall, "
                          f"{r['master_cpu_key_ops_per_s'] or 0:>9,} per master-CPU-s, "
                          f"p50 {r['rpc_p50_us']} us", file=sys.stderr)
            results["ops"] = phases
            if args.tenants:
                results["tenants_cost"] = tenants_cost(phases, args.tenants)
                print(json.dumps(results["tenants_cost"], indent=2), file=sys.stderr)
            if args.quick:
                print(json.dumps(phases, indent=2))
                results["python_loop_us"] = [results["python_loop_us_start"], python_loop_us()]
                print(f"python_loop {results['python_loop_us'][0]} us at the start, "
                      f"{results['python_loop_us'][1]} us at the end (bench_host)",
                      file=sys.stderr)
                if args.json:  # the phases only: no RSS, snapshot or targets
                    with open(args.json, "w") as f:
                        f.write(json.dumps(results, indent=2) + "\n")
                return 0
            c.call(RemoveAll(force=True))
            time.sleep(0.2)
            rss0 = meter.rss()
            fill_s = fill(c, args.objects, "obj")
            time.sleep(0.2)
            rss1 = meter.rss()
            st = c.call(Stats())
            per_obj = (rss1 - rss0) / max(st.objects, 1)
            results["memory"] = {"objects": st.objects, "rss_before": rss0, "rss_after": rss1,
                                 "rss_bytes_per_object": round(per_obj, 1),
                                 "fill_s": round(fill_s, 2),
                                 "fill_objects_per_s": round(args.objects / fill_s)}
            print(f"RSS per object at {st.objects:,}: {per_obj:.0f} B "
                  f"(fill {args.objects / fill_s:,.0f} obj/s)", file=sys.stderr)
            snap = snapshot_pause(m, c)
            results["snapshot"] = snap
            print(f"snapshot: start pause {snap['start_pause_ms']} ms wall / "
                  f"{snap['start_pause_cpu_ms']} ms CPU, longest slice {snap['max_step_ms']} ms "
                  f"({snap['max_step_cpu_ms']} ms CPU), "
                  f"worst PING during {snap['ping_max_ms_during']} ms (before: "
                  f"{snap['ping_max_ms_before']} ms), written in {snap['snapshot_duration_s']} s, "
                  f"load {snap['loadavg']}", file=sys.stderr)
            t0 = time.perf_counter()
            m.kill()
            m.start()
            results["snapshot"]["restart_restore_s"] = round(time.perf_counter() - t0, 2)
            with MasterClient(m.address, timeout_s=30) as c2:
                st2 = c2.call(Stats())
                loading = while_loading(c2, args.objects, t0)
            restored = st2.restored_objects
            snap_out = results["snapshot"]
            snap_out["restored_objects"] = restored
            # the whole restart (process start included) per object
            snap_out["restart_objects_per_s"] = round(restored / snap_out["restart_restore_s"])
            snap_out["restore_s"] = st2.restore_s
            snap_out["unloaded_at_first_answer"] = st2.restore_unloaded
            snap_out.update(loading)
            print(f"restart: {restored:,} objects restored in {snap_out['restart_restore_s']} s "
                  f"({snap_out['restart_objects_per_s']:,}/s) before serving "
                  f"({st2.restore_unloaded:,} left to load); all loaded "
                  f"{loading['restart_loaded_s']} s after the kill; "
                  f"{loading['exist_calls_while_loading']} BatchExist x128 meanwhile: p50 "
                  f"{loading['exist_p50_ms_while_loading']} ms, p99 "
                  f"{loading['exist_p99_ms_while_loading']} ms, max "
                  f"{loading['exist_max_ms_while_loading']} ms", file=sys.stderr)
    best = max((p["master_cpu_key_ops_per_s"] or 0) for p in results["ops"] if p["batch"] == 128)
    put = next(p["master_cpu_key_ops_per_s"] or 0 for p in results["ops"]
               if p["batch"] == 128 and p["op"] == "put")
    rss = results["memory"]["rss_bytes_per_object"]
    results["targets"] = [
        {"name": "batched put key-ops per master CPU-s (capabilities on)",
         "measured": put, "target": 250_000, "ok": put >= 250_000},
        {"name": f"RSS bytes per object at {results['memory']['objects']:,}",
         "measured": rss, "target": 400, "ok": rss <= 400},
    ]
    results["summary"] = {
        "batched_key_ops_per_master_cpu_s_best": best,
        "batched_put_key_ops_per_master_cpu_s": put,
        "batched_key_ops_per_s_wall": {p["op"]: p["key_ops_per_s"] for p in results["ops"]
                                       if p["batch"] == 128},
        "rss_bytes_per_object": results["memory"]["rss_bytes_per_object"],
        "snapshot_pause_ms": results["snapshot"]["start_pause_ms"],
        "snapshot_pause_cpu_ms": results["snapshot"]["start_pause_cpu_ms"],
        "snapshot_max_slice_ms": results["snapshot"]["max_step_ms"],
        "snapshot_max_slice_cpu_ms": results["snapshot"]["max_step_cpu_ms"],
        "loadavg_1m": os.getloadavg()[0],
        "python_loop_us": [results["python_loop_us_start"], python_loop_us()],
        "snapshot_ping_max_ms": results["snapshot"]["ping_max_ms_during"],
        "restart_restore_s": results["snapshot"]["restart_restore_s"],
        "restart_objects_per_s": results["snapshot"]["restart_objects_per_s"],
    }
    out = json.dumps(results, indent=2)
    print(out)
    if args.json:
        with open(args.json, "w") as f:
            f.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark the master's limits (issue 28): restore speed, many clients, a long journal.

Modes (each writes JSON with ``--json``; numbers on stderr as it goes):

``restore``: restart time of a data dir of ``--objects`` objects (40-char
keys, one replica each, 4 segments). Two data dirs are built in-process
through the real Directory + Durability (put batches, group commits): one
whose objects are all in a snapshot (the state after a periodic snapshot)
and one whose objects are all in the journal (a crash before the first
snapshot). Each is then restored ``--repeat`` times in a fresh process
(``Durability.restore``: the one load path a master runs at start), which
reports objects/s and RSS per object. ``--base DIR``: also restore with the
tree in DIR (e.g. ``git worktree add /tmp/lim-base <commit>``), interleaved
run by run with this tree, and report this tree's speed over the base's
(the VM's speed drifts; a ratio of interleaved runs does not).

``clients``: ``--clients 1,8,64,512,512`` concurrent clients, each a thread
with its own connection (ZeroMQ, as clients on other hosts; ``--local
auto``: the direct socket of clients on the master's host), spread over
``--procs`` processes, hammer one master (journal on) with batch ops for
``--seconds`` per level: a put (BATCH_PUT_START + BATCH_PUT_END of
``--batch`` new keys), BATCH_GET_REPLICA_LIST and BATCH_EXIST of them, and
a forced BATCH_REMOVE, so the object count stays flat and memory growth is
a leak. Per level: RPCs/s and key-ops/s, p50/p99/p99.9/max latency per op,
errors by code, and the master's RSS, CPU, queue (bytes waiting in the
kernel's receive queues of its TCP connections, sampled every 50 ms;
ZeroMQ's own queues hold at most one request per synchronous client) and
loop stall (max_loop_ms); at the end, whether the master is alive, answers,
and its RSS growth from the first level to the last and from the top
level's first run to its second (a leak shows there; the first run's
growth is the connections' buffers, kept by the allocator).

``journal``: "a week of journal in an hour". One master (journal on,
``--snapshot-interval-s`` compressed: 2 s here stands for the default 300 s,
so one hour holds ~a week of snapshot cycles) holds ``--live`` objects
while a client streams puts of new keys, removes of the oldest and reads
(read-lease renewals) for ``--seconds``; every ``--restart-every`` seconds
the master is killed (SIGKILL) and restarted: each point reports the data
dir (journal and snapshot bytes and files), the restart seconds and the
objects restored (== the live ones). ``bounded``: the data dir's largest
size in the last third of the points is within 2x of the first half's, and
the restart time's median likewise.

Usage:
  scripts/bench_limits.py journal --seconds 60 --restart-every 10 --live 50000 --json OUT
  scripts/bench_limits.py restore --objects 1000000 [--base /tmp/lim-base] --json OUT
  scripts/bench_limits.py clients --clients 1,8,64,512 --procs 8 --seconds 3 --json OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["main"]

log = logging.getLogger("bench_limits")

_KEYS_PER_BATCH = 4096


def key(prefix: str, i: int) -> str:
    return f"{prefix}-{i:012d}-{(i * 2654435761) & 0xFFFFFFFF:08x}-kvpool-b"[:40]


# ---------------------------------------------------------------- restore
def build_data_dir(path: str, objects: int, snapshot: bool) -> dict[str, Any]:
    """A data dir of ``objects`` objects made by the real write path; with
    ``snapshot`` they end up in a snapshot (journal after it: empty)."""
    from kvpool.core.protocol import SegmentDescriptor, SegmentKind
    from kvpool.master.config import FsyncPolicy, MasterConfig
    from kvpool.master.directory import Directory
    from kvpool.master.durability import Durability

    cfg = MasterConfig(data_dir=path, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    for i in range(4):
        d.mount("bench", SegmentDescriptor(f"bench-seg-{i}", "bench", "host-bench",
                                           SegmentKind.MEMORY, 64 << 40, f"kvpool-bench-seg-{i}"))
    dur.commit(d.records)
    t0 = time.perf_counter()
    for base in range(0, objects, _KEYS_PER_BATCH):
        keys = [key("obj", i) for i in range(base, min(objects, base + _KEYS_PER_BATCH))]
        codes = [0] * len(keys)
        d.writes.put_start_many("bench", keys, [4096] * len(keys), codes, [None] * len(keys))
        if any(codes):
            raise SystemExit(f"fill failed: {codes[:4]}")
        d.writes.commit_many("bench", keys)
        dur.commit(d.records)
    fill_s = time.perf_counter() - t0
    if snapshot:
        dur.request_snapshot()
        while True:
            dur.tick(d, time.monotonic())
            if dur.stats.snapshots:
                break
    assert dur.journal is not None
    dur.close([])
    sizes = {name: os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)}
    return {"objects": len(d.objects), "fill_s": round(fill_s, 2), "files": sizes}


def restore_once() -> dict[str, Any]:
    """(In a fresh process) restore the data dir in argv[2]; print the numbers as JSON."""
    from kvpool.master.config import FsyncPolicy, MasterConfig
    from kvpool.master.directory import Directory
    from kvpool.master.durability import Durability

    path = sys.argv[2]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(f"/proc/{os.getpid()}/statm") as f:
        cur0 = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    cfg = MasterConfig(data_dir=path, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0)
    dur = Durability(cfg)
    t0 = time.perf_counter()
    c0 = time.process_time()
    # as MasterServer does around its restore: no cyclic GC passes over the new objects
    gc.disable()
    d = dur.restore(lambda: Directory(cfg))
    gc.enable()
    gc.freeze()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    # a tree that serves before every object is made (kvpool.master.unloaded):
    # the rest, loaded at once, as the serving loop's steps would
    objects = d.objects
    unloaded = getattr(objects, "unloaded", None)
    left = 0 if unloaded is None else unloaded.count
    if unloaded is not None:
        gc.disable()
        objects.force_all()
        gc.enable()
        gc.freeze()
    loaded = time.perf_counter() - t0
    with open(f"/proc/{os.getpid()}/statm") as f:
        cur1 = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    n = len(d.objects)
    out = {"objects": n, "restore_s": round(wall, 3), "restore_cpu_s": round(cpu, 3),
           "objects_per_s": round(n / wall), "unloaded_at_serving": left,
           "loaded_s": round(loaded, 3), "loaded_objects_per_s": round(n / loaded),
           "rss_bytes_per_object": round((cur1 - cur0) / n, 1),
           "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "rss0_kb": rss0}
    # the newest journal the restore opened is empty: drop it, the next run opens its own
    assert dur.journal is not None
    seq = dur.journal.seq
    dur.close([])
    os.unlink(os.path.join(path, f"journal-{seq:012d}.log"))
    print(json.dumps(out))
    return out


def in_tree(tree: str | None, *args: str) -> dict[str, Any]:
    """Run this script's ``args`` in a fresh process with ``tree`` as the
    package kvpool (None: this tree); its last stdout line (JSON)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="kvpool-base-pkg-") as pkg:
        if tree:  # the base tree as the package kvpool (a link, removed after the run)
            os.symlink(os.path.abspath(tree), os.path.join(pkg, "kvpool"))
            # first on the path, before what else the environment brings there
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg, env.get("PYTHONPATH")]))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env,
                             capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise SystemExit(f"{args[0]} in {tree or 'this tree'} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def restore_mode(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"objects": args.objects, "cpus": os.cpu_count(),
                               "base": args.base, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-restore-") as tmp:
        for case in args.cases.split(","):
            trees = {"base": args.base, "new": None} if args.base else {"new": None}
            built = {}
            for which, tree in trees.items():  # each tree writes its own format
                path = os.path.join(tmp, f"{case}-{which}")
                built[which] = in_tree(tree, "_build", path, str(args.objects), case)
                print(f"{case} {which}: built {built[which]}", file=sys.stderr, flush=True)
            runs: dict[str, list[dict[str, Any]]] = {"new": [], "base": []}
            for _ in range(args.repeat):
                for which, tree in trees.items():
                    r = in_tree(tree, "_restore_once", os.path.join(tmp, f"{case}-{which}"))
                    runs[which].append(r)
                    print(f"{case} {which}: {r['objects']:,} objects in {r['restore_s']} s "
                          f"({r['objects_per_s']:,}/s) until serving, "
                          f"{r.get('unloaded_at_serving', 0):,} left to load then; all loaded "
                          f"in {r.get('loaded_s', r['restore_s'])} s; "
                          f"{r['rss_bytes_per_object']} B/object",
                          file=sys.stderr, flush=True)
            case_out: dict[str, Any] = {"data_dir": built, "runs": runs}
            for which, rs in runs.items():
                if rs:
                    case_out[f"{which}_objects_per_s_median"] = round(
                        statistics.median(r["objects_per_s"] for r in rs))
            if args.base:
                ratios = [n["objects_per_s"] / b["objects_per_s"]
                          for n, b in zip(runs["new"], runs["base"], strict=True)]
                case_out["speedup_per_run"] = [round(x, 2) for x in ratios]
                case_out["speedup_median"] = round(statistics.median(ratios), 2)
            results["cases"][case] = case_out
    return results


# ---------------------------------------------------------------- clients
_OPS = ("put", "get_replica_list", "exist", "remove")


def client_worker(address: str, threads: int, seconds: float, batch: int, tag: str,
                  local: str, out: Any) -> None:
    """(A process of the clients mode) ``threads`` clients hammering the
    master for ``seconds``; puts the latencies and counts on ``out``."""
    import threading as th

    from kvpool.core.protocol import (
        BatchExist,
        BatchGetReplicaList,
        BatchPutEnd,
        BatchPutStart,
        BatchRemove,
    )
    from kvpool.core.rpc_client import MasterClient, MasterRPCError

    start = th.Barrier(threads + 1)
    results: list[dict[str, Any]] = []
    lock = th.Lock()

    def run(i: int) -> None:
        lat: dict[str, list[float]] = {op: [] for op in _OPS}
        errors: dict[str, int] = {}
        key_ops = 0
        n = 0
        client = f"{tag}-{i}"
        with MasterClient(address, timeout_s=30, local=local) as c:
            start.wait()
            end = time.perf_counter() + seconds
            clock = time.perf_counter
            while clock() < end:
                keys = [f"{client}-{n + j}" for j in range(batch)]
                n += batch
                for op in _OPS:
                    t0 = clock()
                    try:
                        if op == "put":
                            r = c.call(BatchPutStart(client, keys, [4096] * batch))
                            c.call(BatchPutEnd(client_id=client, keys=keys))
                            codes = r.codes
                        elif op == "get_replica_list":
                            codes = c.call(BatchGetReplicaList(keys)).codes
                        elif op == "exist":
                            codes = [0]
                            c.call(BatchExist(keys))
                        else:
                            codes = c.call(BatchRemove(keys, force=True)).codes
                        for code in codes:
                            if code:
                                errors[str(code)] = errors.get(str(code), 0) + 1
                    except MasterRPCError as exc:
                        errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                    lat[op].append(clock() - t0)
                    key_ops += batch * (2 if op == "put" else 1)
        with lock:
            results.append({"lat": lat, "errors": errors, "key_ops": key_ops})

    workers = [th.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    for w in workers:
        w.join(seconds + 120)
    out.put(results)


def _queue_bytes(port: int) -> int:
    """Bytes waiting in the receive queues of the TCP connections to ``port``."""
    try:
        lines = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                               capture_output=True, text=True, timeout=5).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return -1
    return sum(int(line.split()[0]) for line in lines if line.split())


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    q = lambda p: round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3, 3)  # noqa: E731
    return {"count": len(xs), "p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999),
            "max_ms": round(xs[-1] * 1e3, 3)}


def clients_mode(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    import psutil

    from kvpool.cluster.processes import MasterProcess
    from kvpool.core.protocol import MountSegment, Ping, SegmentDescriptor, SegmentKind, Stats
    from kvpool.core.rpc_client import MasterClient

    levels = [int(x) for x in args.clients.split(",")]
    ctx = mp.get_context("spawn")  # the parent holds ZeroMQ sockets: no fork
    results: dict[str, Any] = {"cpus": os.cpu_count(), "batch": args.batch,
                               "seconds": args.seconds, "procs": args.procs,
                               "local": args.local, "levels": []}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-clients-") as data:
        extra = ["--snapshot-interval-s", "0"]
        with MasterProcess(data_dir=os.path.join(data, "d"), client_ttl_s=3600,
                           start_timeout_s=120, extra_args=extra) as m, \
                MasterClient(m.address, timeout_s=30) as c:
            assert m.pid is not None
            proc = psutil.Process(m.pid)
            port = int(m.address.rsplit(":", 1)[1])
            for i in range(4):
                c.call(MountSegment(client_id="bench", segment=SegmentDescriptor(
                    f"bench-seg-{i}", "bench", "host-bench", SegmentKind.MEMORY, 64 << 40,
                    f"kvpool-bench-seg-{i}")))
            rss_first = None
            for level in levels:
                nprocs = min(args.procs, level)
                per = [level // nprocs + (1 if i < level % nprocs else 0) for i in range(nprocs)]
                q = ctx.Queue()
                st0 = c.call(Stats())
                cpu0 = sum(proc.cpu_times()[:2])
                rss0 = proc.memory_info().rss
                ps = [ctx.Process(target=client_worker,
                                  args=(m.address, n, args.seconds, args.batch,
                                        f"L{level}p{i}", args.local, q))
                      for i, n in enumerate(per)]
                for p in ps:
                    p.start()
                queue_max = 0
                rss_max = rss0
                got: list[dict[str, Any]] = []
                t0 = time.perf_counter()
                while len(got) < level and time.perf_counter() - t0 < args.seconds + 300:
                    queue_max = max(queue_max, _queue_bytes(port))
                    rss_max = max(rss_max, proc.memory_info().rss)
                    try:
                        got += q.get(timeout=0.05)
                    except Exception:  # queue.Empty
                        pass
                for p in ps:
                    p.join(30)
                st1 = c.call(Stats(), timeout_s=60)
                cpu = sum(proc.cpu_times()[:2]) - cpu0
                rss1 = proc.memory_info().rss
                rss_first = rss_first or rss1
                lat: dict[str, list[float]] = {op: [] for op in _OPS}
                errors: dict[str, int] = {}
                for r in got:
                    for op in _OPS:
                        lat[op] += r["lat"][op]
                    for code, k in r["errors"].items():
                        errors[code] = errors.get(code, 0) + k
                rpcs = sum(len(v) for v in lat.values()) + len(lat["put"])  # a put: 2 RPCs
                key_ops = sum(r["key_ops"] for r in got)
                row = {"clients": level, "procs": nprocs, "clients_reported": len(got),
                       "rpcs_per_s": round(rpcs / args.seconds),
                       "key_ops_per_s": round(key_ops / args.seconds),
                       "latency": {op: _quantiles(v) for op, v in lat.items()},
                       "p99_ms_all": _quantiles([x for v in lat.values() for x in v]).get(
                           "p99_ms"),
                       "errors": errors,
                       "master_cpu_s": round(cpu, 2),
                       "master_rss_before": rss0, "master_rss_after": rss1,
                       "master_rss_max": rss_max,
                       "queue_bytes_max": queue_max,
                       "max_loop_ms": round(st1.max_loop_ms, 2),
                       "too_many_requests": st1.too_many_requests - st0.too_many_requests,
                       "objects_after": st1.objects, "pending_after": st1.pending}
                results["levels"].append(row)
                print(f"clients {level}: {row['rpcs_per_s']:>7,} RPC/s "
                      f"{row['key_ops_per_s']:>9,} key-ops/s, p99 {row['p99_ms_all']} ms, "
                      f"errors {errors}, RSS {rss1 >> 20} MiB, queue max {queue_max} B, "
                      f"clients reported {len(got)}/{level}", file=sys.stderr, flush=True)
            alive = m.running
            ping_ok = False
            if alive:
                c.call(Ping(client_id="bench"), timeout_s=10)
                ping_ok = True
            rss_last = proc.memory_info().rss if alive else 0
            rows = results["levels"]
            # the top level run again (--clients ...,512,512): what it adds is a leak
            again = [r for r in rows if r["clients"] == rows[-1]["clients"]]
            results["check"] = {
                "master_alive": alive, "answers_ping": ping_ok,
                "rss_first_level": rss_first, "rss_last_level": rss_last,
                "rss_growth_bytes": rss_last - (rss_first or 0),
                "rss_growth_top_level_again_bytes":
                    again[-1]["master_rss_after"] - again[-2]["master_rss_after"]
                    if len(again) > 1 else None,
                "queue_bytes_max": max(r["queue_bytes_max"] for r in rows),
                "errors": sum(sum(r["errors"].values()) for r in rows),
                "all_clients_reported": all(r["clients_reported"] == r["clients"] for r in rows),
            }
    return results


# ---------------------------------------------------------------- journal
def _data_dir_sizes(path: str) -> dict[str, int]:
    out = {"journal_bytes": 0, "journal_files": 0, "snapshot_bytes": 0, "snapshot_files": 0}
    for name in os.listdir(path):
        kind = "journal" if name.startswith("journal-") else \
            "snapshot" if name.startswith("snapshot-") else None
        if kind:
            out[f"{kind}_bytes"] += os.path.getsize(os.path.join(path, name))
            out[f"{kind}_files"] += 1
    return out


def journal_mode(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.cluster.processes import MasterProcess
    from kvpool.core.protocol import (
        BatchGetReplicaList,
        BatchPutEnd,
        BatchPutStart,
        BatchRemove,
        MountSegment,
        Ping,
        SegmentDescriptor,
        SegmentKind,
        Stats,
    )
    from kvpool.core.rpc_client import MasterClient

    results: dict[str, Any] = {"seconds": args.seconds, "live": args.live,
                               "snapshot_interval_s": args.snapshot_interval_s,
                               "batch": args.batch, "points": []}
    batch = args.batch
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-journal-") as tmp:
        data = os.path.join(tmp, "d")
        extra = ["--snapshot-interval-s", str(args.snapshot_interval_s)]
        if args.snapshot_journal_records is not None:
            extra += ["--snapshot-journal-records", str(args.snapshot_journal_records)]
        m = MasterProcess(data_dir=data, client_ttl_s=3600, start_timeout_s=300,
                          extra_args=extra)
        m.start()
        try:
            c = MasterClient(m.address, timeout_s=60)
            for i in range(2):
                c.call(MountSegment(client_id="bench", segment=SegmentDescriptor(
                    f"bench-seg-{i}", "bench", "host-bench", SegmentKind.MEMORY, 64 << 40,
                    f"kvpool-bench-seg-{i}")))
            first = 0  # the oldest live key
            nxt = 0  # the next new key
            ops = {"put": 0, "remove": 0, "get": 0, "ping": 0}
            t_end = time.perf_counter() + args.seconds
            next_restart = time.perf_counter() + args.restart_every
            while True:
                now = time.perf_counter()
                if now >= next_restart or now >= t_end:
                    sizes = _data_dir_sizes(data)
                    live = nxt - first
                    before = c.call(Stats())
                    t0 = time.perf_counter()
                    c.close()
                    m.kill()
                    m.start()
                    c = MasterClient(m.address, timeout_s=60)
                    st = c.call(Stats())
                    restart_s = time.perf_counter() - t0
                    point = {"t_s": round(args.seconds - (t_end - now), 1), **sizes,
                             "restart_s": round(restart_s, 3),
                             "restored_objects": st.restored_objects, "live_objects": live,
                             "snapshots_since_start": before.snapshots,
                             "last_snapshot_duration_s": round(
                                 before.last_snapshot_duration_s, 3),
                             "ops_so_far": dict(ops)}
                    results["points"].append(point)
                    print(f"t={point['t_s']:6.1f}s journal {sizes['journal_bytes'] >> 10} KiB "
                          f"in {sizes['journal_files']} files, snapshots "
                          f"{sizes['snapshot_bytes'] >> 10} KiB in {sizes['snapshot_files']}, "
                          f"restart {restart_s:.2f} s, restored {st.restored_objects}/{live}",
                          file=sys.stderr, flush=True)
                    # the segments await their owner after a restart: the owner pings back
                    c.call(Ping(client_id="bench"))
                    if now >= t_end:
                        break
                    next_restart = time.perf_counter() + args.restart_every
                keys = [key("w", i) for i in range(nxt, nxt + batch)]
                c.call(BatchPutStart("bench", keys, [4096] * batch))
                c.call(BatchPutEnd(client_id="bench", keys=keys))
                nxt += batch
                ops["put"] += batch
                if nxt - first > args.live:
                    old = [key("w", i) for i in range(first, first + batch)]
                    c.call(BatchRemove(old, force=True))
                    first += batch
                    ops["remove"] += batch
                # read leases: a batch of live keys, here and there
                base = first + (nxt * 7919) % max(nxt - first - batch, 1)
                c.call(BatchGetReplicaList([key("w", i) for i in range(base, base + batch)]))
                ops["get"] += batch
                c.call(Ping(client_id="bench"))
                ops["ping"] += 1
            c.close()
        finally:
            m.stop()
    pts = results["points"]
    half, third = pts[:max(len(pts) // 2, 1)], pts[-max(len(pts) // 3, 1):]
    disk = lambda r: r["journal_bytes"] + r["snapshot_bytes"]  # noqa: E731
    restart = lambda rows: statistics.median(r["restart_s"] for r in rows)  # noqa: E731
    results["summary"] = {
        "points": len(pts),
        "disk_bytes_first_half_max": max(map(disk, half)),
        "disk_bytes_last_third_max": max(map(disk, third)),
        "files_max": max(r["journal_files"] + r["snapshot_files"] for r in pts),
        "restart_s_first_half_median": restart(half),
        "restart_s_last_third_median": restart(third),
        "restored_all": all(r["restored_objects"] == r["live_objects"] for r in pts),
        # a journal that grows with time passes 2x its early size; restart time
        # (noisy on a shared box: medians, 1 s floor) follows the journal
        "bounded": max(map(disk, third)) <= 2 * max(map(disk, half))
        and restart(third) <= 2 * max(restart(half), 1.0),
    }
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_restore_once":
        restore_once()
        return 0
    if argv and argv[0] == "_build":
        print(json.dumps(build_data_dir(argv[1], int(argv[2]), argv[3] == "snapshot")))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    rp = sub.add_parser("restore", help="restart time of a data dir")
    rp.add_argument("--objects", type=int, default=1_000_000)
    rp.add_argument("--repeat", type=int, default=3)
    rp.add_argument("--cases", default="snapshot,journal",
                    help="snapshot: objects in a snapshot; journal: in the journal only")
    rp.add_argument("--base", help="also restore with this tree (interleaved) and compare")
    rp.add_argument("--json", help="write results here")
    cp = sub.add_parser("clients", help="many concurrent clients against one master")
    cp.add_argument("--clients", default="1,8,64,512,512",
                    help="levels (comma-separated); the top one twice: what the second "
                    "run adds to the master's RSS is a leak")
    cp.add_argument("--procs", type=int, default=8, help="client processes at most")
    cp.add_argument("--seconds", type=float, default=3.0, help="per level")
    cp.add_argument("--batch", type=int, default=32, help="keys per batch op")
    cp.add_argument("--local", default="off", choices=["off", "auto"],
                    help="off: ZeroMQ (clients on other hosts); auto: the direct socket")
    cp.add_argument("--json", help="write results here")
    jp = sub.add_parser("journal", help="a long stream of changes: bounded files, flat restart")
    jp.add_argument("--seconds", type=float, default=60.0)
    jp.add_argument("--restart-every", type=float, default=10.0)
    jp.add_argument("--live", type=int, default=50_000, help="objects held")
    jp.add_argument("--batch", type=int, default=256)
    jp.add_argument("--snapshot-interval-s", type=float, default=2.0)
    jp.add_argument("--snapshot-journal-records", type=int,
                    help="the master's setting (default: its own)")
    jp.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    modes = {"restore": restore_mode, "clients": clients_mode, "journal": journal_mode}
    results = modes[args.mode](args)
    out = json.dumps(results, indent=2)
    print(out)
    if args.json:
        with open(args.json, "w") as f:
            f.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

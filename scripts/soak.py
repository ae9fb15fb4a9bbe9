#!/usr/bin/env python
"""Soak test: a real master + node daemons under mixed load with clients coming and going.

    python scripts/soak.py --minutes 10 [--json OUT] [--sample-s 60]

Starts a master (with a data dir: journal + snapshots) and ``--nodes`` node
daemons contributing ``--node-memory`` each, then keeps ``--clients`` worker
processes running a mix of put/get/remove/exists over a key space several
times larger than the pool (so the master evicts all the time). Workers live
a few seconds to ``--max-life-s`` each and then leave: cleanly, or (pure
clients only, ``--kill-prob``) by SIGKILL; a third of them contribute memory
of their own, so segments are mounted and unmounted all the time.

Every ``--sample-s`` seconds it samples the RSS and open fds of every process
and counts this run's shared-memory files in /dev/shm. It fails (exit 1) if

- a get returned bytes other than those put, or a worker hit an unexpected
  exception or exited badly;
- after warm-up (``--warmup-fraction`` of the samples) the RSS of the master
  or of a node daemon grows more than ``--rss-growth-mib`` or its fd count
  more than ``--fd-growth``;
- shared-memory files outlive their segments: at the end, with every worker
  gone, only the node daemons' segments may remain, and none after shutdown.

The samples are printed as a table (and written with ``--json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("soak")

SIZES = (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024)
# errors a healthy pool gives under eviction pressure and churn
EXPECTED_CODES = {
    "OBJECT_NOT_FOUND", "OBJECT_ALREADY_EXISTS", "NO_AVAILABLE_HANDLE", "OBJECT_HAS_LEASE",
    "LEASE_EXPIRED", "TRANSFER_FAIL", "SEGMENT_NOT_FOUND", "REPLICA_IS_NOT_READY",
    "INVALID_WRITE", "WRITE_FAIL",
}


# ------------------------------------------------------------------------------ worker
def key_for(run: str, idx: int) -> str:
    return f"soak/{run}/{idx}/{SIZES[idx % len(SIZES)]}"


def value_for(key: str) -> bytes:
    import numpy as np

    size = int(key.rsplit("/", 1)[1])
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return np.random.default_rng(seed).bytes(size)


def _block_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def worker_main(args: argparse.Namespace) -> int:
    """One client: mixed ops for ``--seconds``, then a clean exit; JSON stats on stdout."""
    from kvpool.core.errors import ErrorCode, KVPoolError
    from kvpool.store import Client, ClientConfig, ReplicateConfig

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    # spawned with SIGTERM blocked (see spawn_worker): a SIGTERM that came while
    # the interpreter was still starting is delivered now, to the handler
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    rng = random.Random(args.seed)
    stats: dict[str, Any] = {"ops": Counter(), "errors": Counter(), "wrong": 0,
                             "unexpected": []}
    cfg = ClientConfig(master_address=args.master, memory_size=args.worker_memory,
                       host_id=args.host_id, rpc_timeout_s=5.0, transfer_timeout_s=10.0,
                       ping_interval_s=0.5, checksum="crc32")
    deadline = time.monotonic() + args.seconds
    with Client(cfg) as c:
        while time.monotonic() < deadline and not stop["flag"]:
            key = key_for(args.run, rng.randrange(args.keyspace))
            r = rng.random()
            op = "put" if r < 0.45 else "get" if r < 0.85 else "remove" if r < 0.95 else "exists"
            stats["ops"][op] += 1
            try:
                if op == "put":
                    c.put(key, value_for(key),
                          ReplicateConfig(replica_num=1 + (rng.random() < 0.3)))
                elif op == "get":
                    if c.get(key) != value_for(key):
                        stats["wrong"] += 1
                        log.error("WRONG BYTES for %s", key)
                elif op == "remove":
                    c.remove(key)
                else:
                    c.batch_exists([key, key_for(args.run, rng.randrange(args.keyspace))])
            except KVPoolError as exc:
                name = ErrorCode(exc.code).name
                stats["errors"][name] += 1
                if name not in EXPECTED_CODES:
                    stats["unexpected"].append(f"{op} {key}: {exc}")
            except Exception as exc:
                stats["unexpected"].append(f"{op} {key}: {type(exc).__name__}: {exc}")
    # Done: a stop request from now on is moot. Ignore it, because interpreter
    # shutdown puts SIGTERM's default action back (for a Python handler, not for
    # SIG_IGN) and the drain's SIGTERM would turn a clean exit into a -15.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stats["unexpected"] = stats["unexpected"][:20]
    print(json.dumps(stats), flush=True)
    return 0


# ------------------------------------------------------------------------------ driver
@dataclass
class Worker:
    proc: subprocess.Popen[str]
    started: float
    life_s: float
    contributes: bool
    kill_at: float | None = None


@dataclass
class Sample:
    t_s: float
    rss_mib: dict[str, float] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    shm_files: int = 0
    workers: int = 0
    objects: int | None = None
    bytes_used_mib: float | None = None


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = f"soak{os.getpid()}"
        self.rng = random.Random(args.seed)
        self.workers: list[Worker] = []
        self.finished: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.samples: list[Sample] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="kvpool-soak-"))
        self._n = 0

    def shm_files(self) -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"kvpool-{self.run_id}")]

    def spawn_worker(self) -> None:
        a = self.args
        self._n += 1
        contributes = self.rng.random() < 1 / 3
        life = self.rng.uniform(min(3.0, a.max_life_s), a.max_life_s)
        node = self.rng.randrange(a.nodes) + 1
        # same host id as a node daemon: that node is reached through shm, others through tcp
        host_id = f"{self.run_id}-n{node}" if not contributes else f"{self.run_id}-w{self._n}"
        cmd = [sys.executable, __file__, "--worker", "--master", self.master.address,
               "--seconds", f"{life:.1f}", "--seed", str(self.rng.randrange(1 << 30)),
               "--run", self.run_id, "--keyspace", str(a.keyspace), "--host-id", host_id,
               "--worker-memory", str(16 << 20 if contributes else 0)]
        errlog = open(self.workdir / f"worker-{self._n}.log", "ab")
        # SIGTERM stays blocked in the child until its handler is installed: the
        # drain's SIGTERM to a worker still importing must stop it cleanly, not kill it
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errlog, text=True,
                                stdin=subprocess.DEVNULL,
                                preexec_fn=_block_sigterm)
        errlog.close()  # the child holds its own copy
        now = time.monotonic()
        kill_at = None
        if not contributes and self.rng.random() < a.kill_prob:
            kill_at = now + self.rng.uniform(1.0, life)
        self.workers.append(Worker(proc, now, life, contributes, kill_at))

    def reap_workers(self) -> None:
        now = time.monotonic()
        for w in list(self.workers):
            if w.kill_at is not None and now >= w.kill_at and w.proc.poll() is None:
                w.proc.kill()  # a crash: the master must clean up its pending puts
                w.proc.wait()
                self._drain(w, killed=True)
                continue
            if w.proc.poll() is None and now > w.started + w.life_s + 60:
                self.failures.append(f"worker {w.proc.pid} did not finish 60 s after its life")
                w.proc.kill()
                w.proc.wait()
            if w.proc.poll() is not None:
                self._drain(w, killed=False)

    def _drain(self, w: Worker, killed: bool) -> None:
        self.workers.remove(w)
        out = w.proc.stdout.read() if w.proc.stdout else ""
        if w.proc.stdout:
            w.proc.stdout.close()
        if killed:
            self.finished.append({"killed": True})
            return
        if w.proc.returncode != 0 or not out.strip():
            self.failures.append(f"worker {w.proc.pid} exited {w.proc.returncode}")
            return
        stats = json.loads(out.strip().splitlines()[-1])
        self.finished.append(stats)
        if stats["wrong"]:
            self.failures.append(f"worker {w.proc.pid}: {stats['wrong']} gets returned WRONG bytes")
        if stats["unexpected"]:
            self.failures.append(f"worker {w.proc.pid}: unexpected errors {stats['unexpected']}")

    def sample(self, t0: float) -> Sample:
        import psutil

        s = Sample(t_s=round(time.monotonic() - t0, 1))
        procs = {"master": self.master.pid}
        procs.update({f"node{i + 1}": d.pid for i, d in enumerate(self.nodes)})
        procs.update({f"worker{w.proc.pid}": w.proc.pid for w in self.workers})
        for name, pid in procs.items():
            try:
                p = psutil.Process(pid)
                s.rss_mib[name] = round(p.memory_info().rss / 2**20, 1)
                s.fds[name] = p.num_fds()
            except (psutil.Error, TypeError):
                continue
        s.shm_files = len(self.shm_files())
        s.workers = len(self.workers)
        try:
            from kvpool.core.protocol import Stats

            with self.master.client(timeout_s=5) as mc:
                st = mc.call(Stats())
            s.objects = st.objects
            s.bytes_used_mib = round(st.bytes_used / 2**20, 1)
        except Exception as exc:
            self.failures.append(f"STATS failed: {exc}")
        self.samples.append(s)
        log.info("sample %s", asdict(s))
        return s

    def check_growth(self) -> None:
        a = self.args
        if len(self.samples) < 2:
            return
        warm = max(1, int(len(self.samples) * a.warmup_fraction))
        base = self.samples[warm - 1]
        for name in ["master"] + [f"node{i + 1}" for i in range(a.nodes)]:
            later = [s for s in self.samples[warm:] if name in s.rss_mib]
            if name not in base.rss_mib or not later:
                continue
            growth = max(s.rss_mib[name] for s in later) - base.rss_mib[name]
            if growth > a.rss_growth_mib:
                self.failures.append(f"{name} RSS grew {growth:.1f} MiB after warm-up "
                                     f"(bound {a.rss_growth_mib} MiB)")
            fd_growth = max(s.fds[name] for s in later) - base.fds[name]
            if fd_growth > a.fd_growth:
                self.failures.append(f"{name} open fds grew by {fd_growth} after warm-up "
                                     f"(bound {a.fd_growth})")

    def run(self) -> int:
        from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

        a = self.args
        total_s = a.minutes * 60
        sample_s = a.sample_s or max(5.0, min(60.0, total_s / 6))
        self.master = MasterProcess(data_dir=str(self.workdir / "master"), client_ttl_s=3,
                                    lease_ttl_ms=1000,
                                    extra_args=["--snapshot-interval-s", "20"])
        self.nodes: list[Any] = []
        try:
            self.master.start()
            for i in range(a.nodes):
                self.nodes.append(NodeDaemonProcess(
                    self.master.address, a.node_memory, host_id=f"{self.run_id}-n{i + 1}",
                    log_dir=str(self.workdir / f"node{i + 1}")).start())
            t0 = time.monotonic()
            next_sample = t0
            while time.monotonic() - t0 < total_s:
                self.reap_workers()
                while len(self.workers) < a.clients:
                    self.spawn_worker()
                if time.monotonic() >= next_sample:
                    self.sample(t0)
                    next_sample += sample_s
                time.sleep(0.2)
            # drain: no new workers; wait for the live ones to finish
            for w in self.workers:
                if w.proc.poll() is None:
                    w.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while self.workers and time.monotonic() < deadline:
                self.reap_workers()
                time.sleep(0.2)
            for w in list(self.workers):
                w.proc.kill()
                w.proc.wait()
                self.failures.append(f"worker {w.proc.pid} ignored SIGTERM")
                self._drain(w, killed=True)
            time.sleep(4)  # > client_ttl: the master drops killed workers
            final = self.sample(t0)
            if final.shm_files != a.nodes:
                self.failures.append(f"{final.shm_files} shm files with every worker gone; "
                                     f"expected {a.nodes} (one per node daemon): "
                                     f"{self.shm_files()}")
            self.check_growth()
        finally:
            for d in self.nodes:
                d.stop()
            self.master.stop()
        left = self.shm_files()
        if left:
            self.failures.append(f"shm files left after shutdown: {left}")
        return 0 if not self.failures else 1

    def report(self) -> dict[str, Any]:
        ops: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        for st in self.finished:
            ops.update(st.get("ops", {}))
            errors.update(st.get("errors", {}))
        return {
            "args": vars(self.args),
            "samples": [asdict(s) for s in self.samples],
            "workers_finished": len(self.finished),
            "workers_killed": sum(1 for st in self.finished if st.get("killed")),
            "ops": dict(ops),
            "errors": dict(errors),
            "failures": self.failures,
            "ok": not self.failures,
        }


def print_table(rep: dict[str, Any]) -> None:
    samples = rep["samples"]
    names = [n for n in ("master", "node1", "node2", "node3", "node4")
             if any(n in s["rss_mib"] for s in samples)]
    head = f"{'t_s':>7} {'workers':>7} {'objects':>8} {'used_MiB':>8} {'shm':>4} " + " ".join(
        f"{n + '_rss':>11} {n + '_fd':>9}" for n in names)
    print(head)
    for s in samples:
        print(f"{s['t_s']:>7} {s['workers']:>7} {s['objects']!s:>8} {s['bytes_used_mib']!s:>8} "
              f"{s['shm_files']:>4} " + " ".join(
                  f"{s['rss_mib'].get(n, '-')!s:>11} {s['fds'].get(n, '-')!s:>9}" for n in names))
    print(f"ops: {rep['ops']}\nerrors: {rep['errors']}\nworkers finished: "
          f"{rep['workers_finished']} (killed: {rep['workers_killed']})")
    print("RESULT:", "OK" if rep["ok"] else "FAIL")
    for f in rep["failures"]:
        print("  -", f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--json", default=None, help="write the report (samples included) here")
    p.add_argument("--sample-s", type=float, default=0.0,
                   help="seconds between samples (default: 60, or 1/6 of a shorter run)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--node-memory", default="64MiB")
    p.add_argument("--clients", type=int, default=3, help="concurrent worker processes")
    p.add_argument("--max-life-s", type=float, default=15.0)
    p.add_argument("--kill-prob", type=float, default=0.2)
    p.add_argument("--keyspace", type=int, default=1000)
    p.add_argument("--warmup-fraction", type=float, default=0.34)
    p.add_argument("--rss-growth-mib", type=float, default=48.0)
    p.add_argument("--fd-growth", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--run", default="soak", help=argparse.SUPPRESS)
    p.add_argument("--host-id", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-memory", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if not args.worker else logging.WARNING,
                        stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.worker:
        return worker_main(args)
    soak = Soak(args)
    rc = soak.run()
    rep = soak.report()
    print_table(rep)
    if rc == 0:
        shutil.rmtree(soak.workdir, ignore_errors=True)
    else:
        print(f"logs kept in {soak.workdir}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())

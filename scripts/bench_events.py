#!/usr/bin/env python
"""Benchmark the cost of object events on the master (``--events-port``).

Runs a real ``kvpool master`` (data dir, journal fsync ``interval``) per
mode and drives put phases with MasterClient (``bench_master.run_phase``:
batch 1 and batch 128, put_start + put_end = 2 key-ops per object):

- ``off``: no events port (the baseline);
- ``on``: events port, no subscriber;
- ``subscriber``: ``scripts/kv_events.py --quiet`` in its own process
  applies every batch (it must not need a second resync);
- ``stalled``: a SUB socket that never reads (``events_hwm`` 1000), beside
  the same subscriber: the master must not slow down or stall.

Reports per mode and batch: key-ops per wall second, per master CPU second,
RPC p50, and the ratio of each to ``off`` (same run; the 2-core box shares
the client, the subscriber and the master, so wall numbers are relative).

Usage: scripts/bench_events.py [--seconds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_master import Meter, run_phase

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.events import TOPIC
from kvpool.core.protocol import MountSegment, SegmentDescriptor, SegmentKind
from kvpool.core.rpc_client import MasterClient

MODES = ("off", "on", "subscriber", "stalled")


def run_mode(mode: str, seconds: float) -> dict[str, Any]:
    port = find_free_port()
    extra = ["--snapshot-interval-s", "0"]
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-events-") as data:
        if mode != "off":
            cfg = Path(data) / "master.yaml"
            cfg.write_text("events_hwm: 1000\n")
            extra += ["--events-port", str(port), "--config", str(cfg)]
        with MasterProcess(data_dir=os.path.join(data, "d"), client_ttl_s=3600,
                           extra_args=extra) as m, \
                MasterClient(m.address, timeout_s=30) as c:
            assert m.pid is not None
            meter = Meter(m.pid)
            c.call(MountSegment("bench", SegmentDescriptor(
                "bench-seg", "bench", "host-bench", SegmentKind.MEMORY, 64 << 40,
                "kvpool-bench-seg")))
            sub: subprocess.Popen[str] | None = None
            stalled: zmq.Socket[Any] | None = None
            ep = f"tcp://127.0.0.1:{port}"
            if mode in ("subscriber", "stalled"):
                sub = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve().parent / "kv_events.py"),
                     "--events", ep, "--master", m.address, "--quiet"],
                    stdout=subprocess.PIPE, text=True)
                assert sub.stdout is not None
                sub.stdout.readline()  # {"synced": ...}
            if mode == "stalled":
                stalled = zmq.Context.instance().socket(zmq.SUB)
                stalled.setsockopt(zmq.RCVHWM, 1)
                stalled.setsockopt(zmq.RCVBUF, 4096)
                stalled.connect(ep)
                stalled.setsockopt(zmq.SUBSCRIBE, TOPIC)
                time.sleep(0.2)
            out: dict[str, Any] = {"mode": mode, "phases": []}
            try:
                for batch in (1, 128):
                    counter = [0, 0]
                    r = run_phase(c, meter, "put", batch, seconds, f"{mode}{batch}", counter)
                    out["phases"].append(r)
            finally:
                if sub is not None:
                    time.sleep(1.0)  # let it drain the tail
                    sub.send_signal(signal.SIGTERM)
                    tail, _ = sub.communicate(timeout=30)
                    out["subscriber"] = json.loads(tail.strip().splitlines()[-1])["summary"]
                if stalled is not None:
                    stalled.close(0)
            return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per put phase")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
                               "modes": []}
    base: dict[int, dict[str, Any]] = {}
    for mode in MODES:
        r = run_mode(mode, args.seconds)
        for p in r["phases"]:
            if mode == "off":
                base[p["batch"]] = p
            b = base[p["batch"]]
            p["ratio_wall"] = round(p["key_ops_per_s"] / b["key_ops_per_s"], 3)
            cpu, bcpu = p["master_cpu_key_ops_per_s"], b["master_cpu_key_ops_per_s"]
            p["ratio_master_cpu"] = round(cpu / bcpu, 3) if cpu and bcpu else None
            print(f"{mode:10s} batch {p['batch']:4d}: {p['key_ops_per_s']:>9,} key-ops/s wall "
                  f"({p['ratio_wall']}x), {cpu or 0:>9,} per master-CPU-s "
                  f"({p['ratio_master_cpu']}x), p50 {p['rpc_p50_us']} us", file=sys.stderr)
        if "subscriber" in r:
            print(f"{mode:10s} subscriber: {r['subscriber']}", file=sys.stderr)
        results["modes"].append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    else:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

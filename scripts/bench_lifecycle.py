#!/usr/bin/env python
"""Benchmark the segment lifecycle: what the guard process costs and buys.

Against a real ``kvpool master`` (``client_ttl_s`` 1, ``client_grace_s`` 0.5):

- guard start-up: a segment-owning Client's setup with and without its guard
  (median of ``--rounds``; setup does not wait for the guard), the guard's
  spawn-to-ready time and RSS; the floor is a bare ``python -c pass``
  measured in the same run (``guard_ready_vs_python_startup``);
- release after kill -9: a holder process owning a segment is SIGKILLed;
  time until its /dev/shm file is gone and until the master no longer lists
  its segment (the guard's work), median over ``--rounds``;
- a SIGSTOP'ed owner for ``--stop-s`` seconds (> TTL + grace): the master's
  view of its segment sampled every 50 ms (it must never disappear: suspect
  while stopped, active again after SIGCONT), and the time from SIGCONT to
  active.

Usage: scripts/bench_lifecycle.py --json OUT [--rounds 5] [--stop-s 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from kvpool.cluster.processes import MasterProcess
from kvpool.core.protocol import ListSegments
from kvpool.store import Client, ClientConfig

HOLDER = """
import sys, time
from kvpool.store import Client, ClientConfig
c = Client(ClientConfig(master_address=sys.argv[1], memory_size=8 << 20,
                        ping_interval_s=0.2, guard=sys.argv[2] == "1")).setup()
c.put("k", b"x" * 4096)
print(c.segment_ids[0], c.shm_names[0], flush=True)
sys.stdin.read()
"""


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def _segments(m: MasterProcess) -> dict[str, str]:
    with m.client() as mc:
        return {s.descriptor.segment_id: s.state for s in mc.call(ListSegments()).segments}


def bench_startup(m: MasterProcess, rounds: int) -> dict[str, Any]:
    py = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        py.append(time.perf_counter() - t0)
    setup: dict[bool, list[float]] = {True: [], False: []}
    ready, rss = [], []
    for _ in range(rounds):
        for guard in (True, False):
            cfg = ClientConfig(master_address=m.address, memory_size=8 << 20, guard=guard)
            t0 = time.perf_counter()
            with Client(cfg) as c:
                setup[guard].append(time.perf_counter() - t0)
                g = c.segment_host.guard
                if g is not None:
                    assert g.ready(10.0)
                    ready.append(g.ready_s)
                    rss.append(psutil.Process(g.pid).memory_info().rss)
    return {"python_startup_s": _median(py), "guard_ready_s": _median(ready),
            "guard_ready_vs_python_startup": round(statistics.median(ready)
                                                   / statistics.median(py), 2),
            "guard_rss_mib": round(statistics.median(rss) / 2**20, 1),
            "setup_with_guard_s": _median(setup[True]),
            "setup_without_guard_s": _median(setup[False])}


def _holder(m: MasterProcess, guard: bool) -> tuple[subprocess.Popen[str], str, str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, m.address, "1" if guard else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    seg, shm = p.stdout.readline().split()
    return p, seg, shm


def bench_kill9(m: MasterProcess, rounds: int) -> dict[str, Any]:
    unlinked, unmounted = [], []
    for _ in range(rounds):
        p, seg, shm = _holder(m, True)
        t0 = time.perf_counter()
        p.kill()
        p.wait()
        t_file = t_seg = None
        while t_file is None or t_seg is None:
            now = time.perf_counter() - t0
            if t_file is None and not os.path.exists(f"/dev/shm/{shm}"):
                t_file = now
            if t_seg is None and seg not in _segments(m):
                t_seg = now
            if now > 30:
                raise RuntimeError("not released within 30 s")
            time.sleep(0.005)
        unlinked.append(t_file)
        unmounted.append(t_seg)
    return {"kill9_to_shm_unlinked_s": _median(unlinked),
            "kill9_to_unmounted_s": _median(unmounted)}


def bench_sigstop(m: MasterProcess, stop_s: float) -> dict[str, Any]:
    p, seg, _shm = _holder(m, True)
    states: dict[str, int] = {}
    try:
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        first_suspect = None
        while time.perf_counter() - t0 < stop_s:
            st = _segments(m).get(seg, "dropped")
            states[st] = states.get(st, 0) + 1
            if st == "suspect" and first_suspect is None:
                first_suspect = time.perf_counter() - t0
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGCONT)
        t1 = time.perf_counter()
        while _segments(m).get(seg) != "active":
            if time.perf_counter() - t1 > 30:
                raise RuntimeError("not active again within 30 s")
            time.sleep(0.01)
        back = time.perf_counter() - t1
    finally:
        os.kill(p.pid, signal.SIGCONT)
        assert p.stdin is not None
        p.stdin.close()
        p.wait(30)
    return {"stop_s": stop_s, "state_samples": states,
            "stopped_to_suspect_s": round(first_suspect or -1.0, 3),
            "sigcont_to_active_s": round(back, 3), "never_dropped": "dropped" not in states}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stop-s", type=float, default=5.0)
    args = ap.parse_args()
    with MasterProcess(client_ttl_s=1.0, extra_args=["--client-grace-s", "0.5"]) as m:
        out = {"ttl_s": 1.0, "grace_s": 0.5, "loadavg": os.getloadavg()[0],
               **bench_startup(m, args.rounds), **bench_kill9(m, args.rounds),
               "sigstop": bench_sigstop(m, args.stop_s)}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

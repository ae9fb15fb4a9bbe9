#!/usr/bin/env python
"""What a master round trip costs after the caller did something else.

A real master and node daemon on this host, one client (tcp forced, another
host id, as a client on another host would reach them). For each value size,
``batch_locate`` of one stored key is timed (p50 over ``--rounds`` x 10 keys)
right after:

- ``nothing``: back to back (the master still polls from its last answer);
- ``sleep``: a ``--sleep-ms`` pause (the master's thread, and the core under
  it, go idle; the master polls ``rpc_spin_us`` after an answer);
- ``memcpy``: a copy of the value's size in the client (cold caches);
- ``get``: a ``get_into`` of that key (what a read loop does between calls).

Inside a large call the master legs pay the second to fourth kind, between
small calls the first (docs/BENCHMARKS.md, "Single ops are round trips")::

    .venv/bin/python scripts/bench_idle_rpc.py --json out/idle_rpc.json \
        [--master-arg=--rpc-spin-us=2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

FORCE_TCP = {"rules": [{"name": "bench-force-tcp", "transports": ["tcp"]}]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="write the records here")
    p.add_argument("--sizes", default="4096,2097152,16777216")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--sleep-ms", type=float, default=3.0)
    p.add_argument("--master-arg", action="append", default=[], metavar="FLAG")
    args = p.parse_args(argv)
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.core.config import setup_logging
    from kvpool.store import Client, ClientConfig

    setup_logging("WARNING")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-idle-rpc-") as tmp, \
            MasterProcess(data_dir=tmp, extra_args=args.master_arg) as m, \
            NodeDaemonProcess(m.address, f"{3 * max(sizes) * 10 // (1 << 20) + 16}MiB"), \
            Client(ClientConfig(master_address=m.address, transfer_overrides=FORCE_TCP,
                                host_id="bench-elsewhere")) as c:
        for size in sizes:
            value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            handle = c.register_buffer(value)
            keys = [f"idle-rpc/{size}/{i}" for i in range(10)]
            for k in keys:
                c.put_from(k, handle)
            src, dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
            for after in ("nothing", "sleep", "memcpy", "get"):
                lat = []
                for _ in range(args.rounds):
                    for k in keys:
                        if after == "sleep":
                            time.sleep(args.sleep_ms / 1e3)
                        elif after == "memcpy":
                            np.copyto(dst, src)
                        elif after == "get":
                            c.get_into(k, handle)
                        t = time.perf_counter()
                        c.batch_locate([k])
                        lat.append(time.perf_counter() - t)
                rec = {"op": "locate", "after": after, "size": size,
                       "p50_us": round(statistics.median(lat) * 1e6, 1),
                       "p90_us": round(sorted(lat)[int(0.9 * len(lat))] * 1e6, 1)}
                records.append(rec)
                print(f"locate after {after:8} size {size:>9}: p50 {rec['p50_us']:7.1f} us "
                      f"p90 {rec['p90_us']:7.1f} us", file=sys.stderr)
            c.unregister_buffer(handle)
            c.remove_all(force=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Follow a kvpool master's object events: a runnable subscriber example.

Subscribes to ``kvpool master --events-port P``, builds the pool's state
from a listing (``LIST_OBJECTS``), keeps it exact from the event batches,
and prints each event as one JSON line (docs/events.md)::

    scripts/kv_events.py --events tcp://127.0.0.1:P --master 127.0.0.1:50051
    {"event": "stored", "key": "kvpool/v3/...", "size": 131072,
     "replicas": [["seg-1", "dram"]]}
    {"event": "removed", "key": "kvpool/v3/..."}

``--prefix`` keeps one model's keys (connector keys start with
``kvpool/v3/<model>/``); ``--quiet`` prints nothing per event; at exit
(SIGINT, SIGTERM, ``--count`` events or ``--seconds``) a summary line goes
to stdout: objects and bytes per tier, batches, resyncs. With CURVE on the
master, pass the client's keys (``--curve-key``, ``--curve-server-key``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from kvpool.core.auth import CurveConfig
from kvpool.core.events import (
    Event,
    EventSubscriber,
    ObjectRemoved,
    ObjectStored,
    PoolView,
    ReplicaRemoved,
    SegmentAdded,
    SegmentRemoved,
)
from kvpool.core.rpc_client import MasterClient


def as_json(ev: Event) -> dict[str, Any]:
    if type(ev) is ObjectStored:
        return {"event": "stored", "key": ev.key, "size": ev.size,
                "replicas": [[r.segment, r.tier.value] for r in ev.replicas]}
    if type(ev) is ObjectRemoved:
        return {"event": "removed", "key": ev.key}
    if type(ev) is ReplicaRemoved:
        return {"event": "replica_removed", "key": ev.key, "segment": ev.segment}
    if type(ev) is SegmentAdded:
        return {"event": "segment_added", "segment": ev.segment,
                "tier": ev.tier.value, "host": ev.host, "size": ev.size}
    assert type(ev) is SegmentRemoved
    return {"event": "segment_removed", "segment": ev.segment}


def summary(sub: EventSubscriber, events: int) -> dict[str, Any]:
    view: PoolView = sub.view
    tiers: dict[str, dict[str, int]] = {}
    for obj in view.objects.values():
        for r in obj.replicas:
            t = tiers.setdefault(r.tier.value, {"objects": 0, "bytes": 0})
            t["objects"] += 1
            t["bytes"] += obj.size
    return {"objects": len(view), "segments": len(view.segments), "tiers": tiers,
            "events": events, "batches": sub.batches, "resyncs": sub.resyncs,
            "seq": sub.seq, "stream": sub.stream, "epoch": sub.epoch}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", required=True, action="append",
                    help="the master's events endpoint tcp://HOST:PORT (repeat for every "
                         "instance of an HA group)")
    ap.add_argument("--master", required=True, help="the master's RPC address HOST:PORT")
    ap.add_argument("--prefix", default="", help="only keys starting with this")
    ap.add_argument("--curve-key", help="this client's secret key file (CURVE)")
    ap.add_argument("--curve-server-key", help="the master's public key file (CURVE)")
    ap.add_argument("--count", type=int, default=0, help="exit after this many events")
    ap.add_argument("--seconds", type=float, default=0, help="exit after this long")
    ap.add_argument("--quiet", action="store_true", help="no line per event")
    args = ap.parse_args(argv)

    curve = None
    server_key = keypair = None
    if args.curve_key:
        curve = CurveConfig(enabled=True, secret_key_file=args.curve_key,
                            server_public_key_file=args.curve_server_key or "")
        kp = curve.keypair()
        server_key, keypair = curve.server_public_key(), (kp.public, kp.secret)
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    end = time.monotonic() + args.seconds if args.seconds else float("inf")
    events = 0
    with MasterClient(args.master, curve_server_key=server_key, curve_keypair=keypair) as mc, \
            EventSubscriber(args.events, mc, prefix=args.prefix, curve=curve) as sub:
        sub.sync()
        print(json.dumps({"synced": summary(sub, 0)}), flush=True)
        while not stop and time.monotonic() < end and not (args.count and events >= args.count):
            got = sub.poll(min(0.2, max(0.0, end - time.monotonic())))
            events += len(got)
            if not args.quiet and got:
                sys.stdout.write("".join(json.dumps(as_json(ev)) + "\n" for ev in got))
                sys.stdout.flush()
        print(json.dumps({"summary": summary(sub, events)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

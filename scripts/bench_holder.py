#!/usr/bin/env python
"""Server-side CPU per request of the 4 KiB store path, in-process (no wall clock).

Three measurements, each the CPU time (``thread_time`` / ``process_time``)
of the server code alone, reported as the minimum and median over rounds
(the minimum is what the code costs; the median shows how much a loaded
box adds):

- ``checks``: the holder's validation of one bulk WRITE request of
  ``--ranges`` 4 KiB ranges under one batch token (decode + per-range
  segment, bounds and capability checks), as the node daemon's transfer
  engine runs it (real ``TransferEngine``, real segment key and verifier,
  a new token per request as the master grants them).
- ``serve``: the whole ``BulkServer._serve_one`` of such a request over a
  local socket pair (header read, checks, payload received into the
  segment, reply), with 1 range and with ``--ranges``.
- ``master``: ``OpHandlers.handle_payload`` of BATCH_PUT_START +
  BATCH_PUT_END of ``--ranges`` keys, and of PUT_START + PUT_END of one key
  (capabilities on, journal records built), against one segment.

Usage: scripts/bench_holder.py [--ranges 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.core.capability import CapabilitySigner, CapOp
from kvpool.core.protocol import (
    BatchPutEnd,
    BatchPutStart,
    PutEnd,
    PutStart,
    SegmentDescriptor,
    SegmentKind,
    encode_request,
)
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.handlers import OpHandlers
from kvpool.master.tiering import TieringConfig, TieringPolicy
from kvpool.transfer import MemorySegment, TransferEngine, TransferOp, load_transfer_config, wire
from kvpool.transfer.bulk import BulkStream, bulk_frame

SIZE = 4096


def _stats(name: str, per_request: list[float], ranges: int) -> dict[str, Any]:
    lo, med = min(per_request), statistics.median(per_request)
    print(f"{name:28s} min {lo * 1e6:8.1f} us  median {med * 1e6:8.1f} us  "
          f"per range/key-op {lo / ranges * 1e6:6.2f} us", file=sys.stderr)
    return {"name": name, "ranges": ranges, "cpu_us_min": round(lo * 1e6, 1),
            "cpu_us_median": round(med * 1e6, 1)}


class _Holder:
    """A transfer engine with one 64 MiB segment whose key a signer holds."""

    def __init__(self) -> None:
        base = {"transports": {"tcp": {"timeout_s": 3.0}, "shm": {"timeout_s": 3.0}}}
        self.engine = TransferEngine(load_transfer_config(overrides=base), "bench-holder")
        self.seg = MemorySegment.create(f"bench-{uuid.uuid4().hex[:8]}", 64 << 20)
        self.sid = self.engine.add_local_segment(self.seg).segment_id
        self.signer = CapabilitySigner()
        self.engine.set_capability_key(self.sid, self.signer.key_for(self.sid))
        server = self.engine.server
        assert server is not None and server.bulk is not None
        self.bulk = server.bulk

    def request(self, rid: int, ranges: int) -> bytes:
        """A framed WRITE request of ``ranges`` ranges under one new token."""
        off0 = (rid % 400) * ranges * SIZE % ((64 << 20) - ranges * SIZE)
        flat = [v for i in range(ranges) for v in (off0 + i * SIZE, SIZE)]
        tok = self.signer.grant_ranges(self.sid, flat, int(CapOp.WRITE),
                                       self.signer.expiry(600_000))
        items = [wire.BulkItem(self.sid, off0 + i * SIZE, SIZE, 0) for i in range(ranges)]
        return bulk_frame(wire.BulkRequest(rid, int(TransferOp.WRITE), items, caps=[tok]))

    def close(self) -> None:
        self.engine.close()
        self.seg.close()


def bench_checks(h: _Holder, ranges: int, rounds: int, per_round: int) -> dict[str, Any]:
    check = h.bulk._check
    out = []
    rid = 0
    for _ in range(rounds):
        reqs = []
        for _ in range(per_round):
            rid += 1
            reqs.append(h.request(rid, ranges)[4:])
        t0 = time.process_time()
        for raw in reqs:
            _codes, _segs, err = check(wire.decode_bulk_request(raw))
            if err:
                raise RuntimeError(err)
        out.append((time.process_time() - t0) / per_round)
    return _stats(f"holder checks x{ranges}", out, ranges)


def bench_serve(h: _Holder, ranges: int, rounds: int, per_round: int) -> dict[str, Any]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    total = rounds * per_round
    reqs = [h.request(i + 1, ranges) for i in range(total)]
    payload = bytes(SIZE * ranges)
    out: list[float] = []

    def serve() -> None:
        stream = BulkStream(b, 1 << 16)
        scratch = memoryview(bytearray(1 << 16))
        for _ in range(rounds):
            t0 = time.thread_time()
            for _ in range(per_round):
                if not h.bulk._serve_one(stream, scratch):
                    return
            out.append((time.thread_time() - t0) / per_round)

    def drain() -> None:
        while a.recv(1 << 16):
            pass

    server = threading.Thread(target=serve)
    server.start()
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    for r in reqs:
        a.sendall(r)
        a.sendall(payload)
    server.join()
    b.close()  # the drain thread sees EOF
    reader.join(timeout=5)
    a.close()
    return _stats(f"holder serve x{ranges}", out, ranges)


def bench_master(keys: int, rounds: int, per_round: int) -> list[dict[str, Any]]:
    cfg = MasterConfig()
    policy = TieringPolicy(TieringConfig())
    d = Directory(cfg, hooks=policy)
    d.journaling = True
    signer = CapabilitySigner(cfg.lease_ttl_ms)
    d.mount("bench", SegmentDescriptor("seg0", "bench", "h", SegmentKind.MEMORY, 64 << 40,
                                       "kvpool-bench-seg0"))
    signer.rotate("seg0")
    handle = OpHandlers(cfg, d, policy, signer).handle_payload
    n = 0

    def run(make: Callable[[list[str]], tuple[bytes, bytes]], batch: int) -> list[float]:
        nonlocal n
        res = []
        for _ in range(rounds):
            reqs = []
            for _ in range(per_round):
                ks = [f"bench-key-{n + i:030d}" for i in range(batch)]
                n += batch
                reqs.append(make(ks))
            t0 = time.process_time()
            for start, end in reqs:
                handle(start)
                handle(end)
                d.records.clear()
            res.append((time.process_time() - t0) / per_round)
        return res

    batch = run(lambda ks: (encode_request(1, BatchPutStart("bench", ks, [SIZE] * len(ks))),
                            encode_request(2, BatchPutEnd("bench", ks))), keys)
    single = run(lambda ks: (encode_request(1, PutStart("bench", ks[0], SIZE)),
                             encode_request(2, PutEnd("bench", ks[0]))), 1)
    return [_stats(f"master batch put x{keys}", batch, 2 * keys),
            _stats("master put x1", single, 2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranges", type=int, default=32, help="ranges (keys) per request")
    ap.add_argument("--rounds", type=int, default=9, help="rounds per measurement")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    h = _Holder()
    try:
        results.append(bench_checks(h, args.ranges, args.rounds, 500))
        results.append(bench_serve(h, args.ranges, args.rounds, 250))
        results.append(bench_serve(h, 1, args.rounds, 1000))
    finally:
        h.close()
    results += bench_master(args.ranges, args.rounds, 200)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

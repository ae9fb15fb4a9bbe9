#!/usr/bin/env python
"""The master's CPU per single-key op, in process: a request frame decoded,
handled and its reply encoded by ``OpHandlers.handle_payload`` (the code a
served request runs, without the socket and the loop around it), so two
trees compare at sub-µs resolution where a served round trip's noise is tens
of µs.

Ops: PUT_START + PUT_END of a new key; PUT_COMMIT of a reservation asking
for the next one (the store client's single put through a spare, its reply
decoded for the next placeholder); BATCH_GET_REPLICA_LIST of one key; EXIST.
Median of ``--rounds`` rounds of ``--calls`` calls (process CPU time). The
JSON is a list of records ``{transport: "master-ops", op, size, batch: 1,
cpu_us_per_call}`` that ``scripts/bench_ab.py`` compares between trees::

    .venv/bin/python scripts/bench_master_ops.py --json out/master_ops.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

SIZE = 4096


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the records here")
    p.add_argument("--rounds", type=int, default=15, help="rounds per op (the median is kept)")
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    args = p.parse_args()

    from kvpool.core.capability import CapabilitySigner
    from kvpool.core.protocol import (
        BatchGetReplicaList,
        Exist,
        PutCommit,
        PutEnd,
        PutStart,
        ReserveReply,
        SegmentDescriptor,
        SegmentKind,
        decode_reply,
        encode_request,
    )
    from kvpool.master.config import MasterConfig
    from kvpool.master.directory import Directory
    from kvpool.master.handlers import OpHandlers
    from kvpool.master.tiering import TieringPolicy

    cfg = MasterConfig()
    policy = TieringPolicy(cfg.tiering)
    try:
        d = Directory(cfg, hooks=policy)
    except TypeError:  # a tree before Directory took hooks= (bench_ab.py against it)
        d = Directory(cfg, policy=policy)  # type: ignore[call-arg]
    d.journaling = True
    signer = CapabilitySigner(cfg.lease_ttl_ms)
    d.mount("bench", SegmentDescriptor("seg0", "bench", "h", SegmentKind.MEMORY, 64 << 40,
                                       "kvpool-bench-seg0"))
    signer.rotate("seg0")
    handle = OpHandlers(cfg, d, policy, signer).handle_payload
    reserve = msgspec.msgpack.Decoder(ReserveReply)
    made = iter(range(1 << 62))

    def key() -> str:
        return f"bench-key-{next(made):030d}"

    def median_us(make: Callable[[], list[Any]], run: Callable[[Any], None]) -> float:
        res = []
        for _ in range(args.rounds):
            work = make()
            t0 = time.process_time()
            for w in work:
                run(w)
            res.append((time.process_time() - t0) / args.calls * 1e6)
            d.records.clear()
        return round(statistics.median(res), 3)

    def start_end(ks: tuple[bytes, bytes]) -> None:
        handle(ks[0])
        handle(ks[1])

    def pairs() -> list[Any]:
        out = []
        for _ in range(args.calls):
            k = key()
            out.append((encode_request(1, PutStart("bench", k, SIZE)),
                        encode_request(2, PutEnd("bench", k))))
        return out

    k0 = key()
    handle(encode_request(1, PutStart("bench", k0, SIZE)))
    held = [reserve.decode(decode_reply(handle(encode_request(2, PutEnd("bench", k0, SIZE))))
                           .result).placeholder]

    def commit(k: str) -> None:  # the request names the reservation the last reply made
        out = handle(encode_request(3, PutCommit("bench", held[0], k, SIZE)))
        held[0] = reserve.decode(decode_reply(out).result).placeholder

    stored = [key() for _ in range(args.calls)]
    for k in stored:
        start_end((encode_request(1, PutStart("bench", k, SIZE)),
                   encode_request(2, PutEnd("bench", k))))
    locate = [encode_request(4, BatchGetReplicaList([k])) for k in stored]
    exist = [encode_request(5, Exist(k)) for k in stored]
    records = [
        ("put_start+put_end", median_us(pairs, start_end)),
        ("put_commit+reserve", median_us(lambda: [key() for _ in range(args.calls)], commit)),
        ("batch_get_replica_list", median_us(lambda: locate, handle)),
        ("exist", median_us(lambda: exist, handle)),
    ]
    out = [{"transport": "master-ops", "op": op, "size": SIZE, "batch": 1, "cpu_us_per_call": us}
           for op, us in records]
    for r in out:
        print(f"{r['op']:24s} {r['cpu_us_per_call']:7.2f} us")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

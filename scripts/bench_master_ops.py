#!/usr/bin/env python
"""The master's CPU per single-key op, in process: a request frame decoded,
handled and its reply encoded by ``OpHandlers.handle_payload`` (the code a
served request runs, without the socket and the loop around it), so two
trees compare at sub-µs resolution where a served round trip's noise is tens
of µs.

Ops: PUT_START + PUT_END of a new key (``--batch N``: every op's batch form
with N keys per request); PUT_COMMIT of a reservation asking
for the next one (the store client's single put through a spare, its reply
decoded for the next placeholder); BATCH_GET_REPLICA_LIST of one key; EXIST.
Median of ``--rounds`` rounds of ``--calls`` calls (process CPU time).
``--tenant NAME``: the master has that tenant configured (a quota far above
what the run stores) and every request acts for it, so a run with and one
without compare a tenant's cost per op (docs/tenants.md; the records carry
``tenant``). The
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
    p.add_argument("--batch", type=int, default=1,
                   help="keys per request (> 1: the batch ops; PUT_COMMIT is measured at 1 only)")
    p.add_argument("--tenant", default="",
                   help="act for this tenant (configured with a 1 PiB quota); default: none")
    args = p.parse_args()
    tenant = args.tenant
    batch = args.batch

    from kvpool.core.capability import CapabilitySigner
    from kvpool.core.protocol import (
        BatchExist,
        BatchGetReplicaList,
        BatchPutEnd,
        BatchPutStart,
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
    if tenant:  # a quota never reached: the accounting's cost only
        cfg.tenants = {tenant: {"memory": 1 << 50, "disk": 1 << 50}}
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

    def keys() -> list[str]:
        return [key() for _ in range(batch)]

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

    def start_end_frames(ks: list[str]) -> tuple[bytes, bytes]:
        if batch == 1:
            return (encode_request(1, PutStart("bench", ks[0], SIZE, tenant=tenant)),
                    encode_request(2, PutEnd("bench", ks[0], tenant=tenant)))
        return (encode_request(1, BatchPutStart("bench", ks, [SIZE] * batch, tenant=tenant)),
                encode_request(2, BatchPutEnd("bench", ks, tenant=tenant)))

    def pairs() -> list[Any]:
        return [start_end_frames(keys()) for _ in range(args.calls)]

    k0 = key()
    handle(encode_request(1, PutStart("bench", k0, SIZE, tenant=tenant)))
    held = [reserve.decode(decode_reply(handle(encode_request(
        2, PutEnd("bench", k0, SIZE, tenant=tenant)))).result).placeholder]

    def commit(k: str) -> None:  # the request names the reservation the last reply made
        out = handle(encode_request(3, PutCommit("bench", held[0], k, SIZE, tenant=tenant)))
        held[0] = reserve.decode(decode_reply(out).result).placeholder

    stored = [keys() for _ in range(args.calls)]
    for ks in stored:
        start_end(start_end_frames(ks))
    if batch == 1:
        locate = [encode_request(4, BatchGetReplicaList(ks, tenant=tenant)) for ks in stored]
        exist = [encode_request(5, Exist(ks[0], tenant=tenant)) for ks in stored]
    else:
        locate = [encode_request(4, BatchGetReplicaList(ks, tenant=tenant)) for ks in stored]
        exist = [encode_request(5, BatchExist(ks, tenant=tenant)) for ks in stored]
    records = [("put_start+put_end", median_us(pairs, start_end))]
    if batch == 1:  # (a batch's commit through reservations: BATCH_PUT_COMMIT, not measured)
        records.append(("put_commit+reserve",
                        median_us(lambda: [key() for _ in range(args.calls)], commit)))
    records += [("batch_get_replica_list", median_us(lambda: locate, handle)),
                ("exist", median_us(lambda: exist, handle))]
    out = [{"transport": "master-ops", "op": op, "size": SIZE, "batch": batch,
            "cpu_us_per_call": us, "cpu_us_per_key": round(us / batch, 3),
            **({"tenant": tenant} if tenant else {})}
           for op, us in records]
    for r in out:
        print(f"{r['op']:24s} {r['cpu_us_per_call']:9.2f} us  ({r['cpu_us_per_key']:.3f} per key)")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

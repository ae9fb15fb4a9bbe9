#!/usr/bin/env python
"""The master's CPU per op, in process: a request frame decoded, handled and
its reply encoded by ``OpHandlers.handle_payload`` (the code a served request
runs, without the socket and the loop around it), so two trees compare at
sub-µs resolution where a served round trip's noise is tens of µs.

Ops: PUT_START + PUT_END of new keys; PUT_COMMIT of a reservation asking for
the next one (the store client's single put through a spare, its reply
decoded for the next placeholder; at ``--batch 1`` only);
BATCH_GET_REPLICA_LIST; EXIST (BATCH_EXIST at ``--batch`` > 1). Median of
``--rounds`` rounds of ``--calls`` calls (process CPU time). The JSON is a
list of records ``{transport: "master-ops", op, size, batch,
cpu_us_per_call, cpu_us_per_key}`` that ``scripts/bench_ab.py`` compares
between trees::

    .venv/bin/python scripts/bench_master_ops.py --json out/master_ops.json

``--tenants N`` (the tenants' cost, docs/tenants.md): the master has N
tenants configured (quotas far above what the run stores) and every op runs
in both modes on the same directory, round by round in the order 0, N, N, 0,
...: without tenants, and with its requests spread over the N tenants round
robin. The records carry ``tenants`` (0 or N), and one record per op
``{op: "<op>/tenants_cost", ratio}``: CPU per call without over with (> 0.95
is the target).
"""

from __future__ import annotations

import argparse
import gc
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
    p.add_argument("--rounds", type=int, default=15, help="rounds per op and mode (the median "
                   "is kept)")
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--batch", type=int, default=1,
                   help="keys per request (> 1: the batch ops; PUT_COMMIT is measured at 1 only)")
    p.add_argument("--tenants", type=int, default=0,
                   help="also run every op with its requests spread over this many tenants, "
                   "interleaved with the runs without; reports the ratio")
    args = p.parse_args()
    batch = args.batch
    modes = [0, args.tenants] if args.tenants else [0]

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
    # quotas never reached: the accounting's cost only
    cfg.tenants = {f"t{i}": {"memory": 1 << 50, "disk": 1 << 50} for i in range(args.tenants)}
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
    calls = 0  # of each mode's requests: the round robin over its tenants

    def tenant_of(mode: int) -> str:
        nonlocal calls
        calls += 1
        return f"t{calls % mode}" if mode else ""

    def keys() -> list[str]:
        return [f"bench-key-{next(made):030d}" for _ in range(batch)]

    def start_end(frames: tuple[bytes, bytes]) -> None:
        handle(frames[0])
        handle(frames[1])

    def start_end_frames(ks: list[str], tenant: str) -> tuple[bytes, bytes]:
        if batch == 1:
            return (encode_request(1, PutStart("bench", ks[0], SIZE, tenant=tenant)),
                    encode_request(2, PutEnd("bench", ks[0], tenant=tenant)))
        return (encode_request(1, BatchPutStart("bench", ks, [SIZE] * batch, tenant=tenant)),
                encode_request(2, BatchPutEnd("bench", ks, tenant=tenant)))

    # each mode's stored keys (with their tenants), read back by its reads
    stored: dict[int, list[tuple[list[str], str]]] = {}
    for mode in modes:
        stored[mode] = [(keys(), tenant_of(mode)) for _ in range(args.calls)]
        for ks, t in stored[mode]:
            start_end(start_end_frames(ks, t))
    held: dict[int, list[Any]] = {}  # each mode's reservation, named by the next commit

    def reserved(k: str, tenant: str) -> Any:
        handle(encode_request(1, PutStart("bench", k, SIZE, tenant=tenant)))
        out = handle(encode_request(2, PutEnd("bench", k, SIZE, tenant=tenant)))
        return reserve.decode(decode_reply(out).result).placeholder

    def committer(mode: int) -> Callable[[tuple[str, str]], None]:
        if mode not in held:
            held[mode] = [reserved(keys()[0], tenant_of(mode))]
        h = held[mode]

        def commit(kt: tuple[str, str]) -> None:  # names the reservation the last reply made
            out = handle(encode_request(3, PutCommit("bench", h[0], kt[0], SIZE, tenant=kt[1])))
            h[0] = reserve.decode(decode_reply(out).result).placeholder
        return commit

    # op -> (make a round's work for a mode, run one item of a mode)
    ops: dict[str, tuple[Callable[[int], list[Any]], Callable[[int], Callable[[Any], None]]]] = {
        "put_start+put_end": (
            lambda m: [start_end_frames(keys(), tenant_of(m)) for _ in range(args.calls)],
            lambda m: start_end),
    }
    if batch == 1:  # (a batch's commit through reservations: BATCH_PUT_COMMIT, not measured)
        ops["put_commit+reserve"] = (
            lambda m: [(keys()[0], tenant_of(m)) for _ in range(args.calls)], committer)
    locate = {m: [encode_request(4, BatchGetReplicaList(ks, tenant=t)) for ks, t in stored[m]]
              for m in modes}
    exist = {m: [encode_request(5, Exist(ks[0], tenant=t) if batch == 1
                                else BatchExist(ks, tenant=t)) for ks, t in stored[m]]
             for m in modes}
    ops["batch_get_replica_list"] = (lambda m: locate[m], lambda m: handle)
    ops["exist"] = (lambda m: exist[m], lambda m: handle)

    out: list[dict[str, Any]] = []
    for op, (make, runner) in ops.items():
        per_call: dict[int, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                work = make(mode)
                run = runner(mode)
                # as the master's loop does every second: a full collection's
                # cost is not charged to whichever run its turn came in
                gc.freeze()
                t0 = time.process_time()
                for w in work:
                    run(w)
                per_call[mode].append((time.process_time() - t0) / args.calls * 1e6)
            d.records.clear()
        us = {m: round(statistics.median(v), 3) for m, v in per_call.items()}
        for m in modes:
            rec: dict[str, Any] = {"transport": "master-ops", "op": op, "size": SIZE,
                                   "batch": batch, "cpu_us_per_call": us[m],
                                   "cpu_us_per_key": round(us[m] / batch, 3)}
            if args.tenants:
                rec["tenants"] = m
            out.append(rec)
            print(f"{op:24s} tenants {m}: {us[m]:9.2f} us  ({us[m] / batch:.3f} per key)")
        if args.tenants:
            ratio = round(us[0] / us[args.tenants], 4)
            out.append({"transport": "master-ops", "op": f"{op}/tenants_cost", "size": SIZE,
                        "batch": batch, "ratio": ratio})
            print(f"{op:24s} tenants' cost: {ratio:.3f} of the CPU-rate without")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""SSD-tier benchmark: file-segment WRITE and READ through the transfer engine
(``posix``, and ``gds`` where kvikio can run) and through the store, each
against a raw O_DIRECT loop of the same request size measured in the same run.

For each size (1 MiB, 16 MiB) and batch (1, 8): the engine writes
``--total`` bytes into a :class:`FileSegment` (4 KiB-aligned buffers, so the
posix transport takes its O_DIRECT path; the final fdatasync is inside the
timing) and reads them back **cold**: the page cache is dropped before every
read pass (``/proc/sys/vm/drop_caches`` where permitted, else
``posix_fadvise(DONTNEED)`` on the file after a sync; O_DIRECT reads bypass it
anyway). ``posix-buffered`` repeats with unaligned buffers (the page-cache
path, reads still cold). The limit, transport ``disk``, is a plain O_DIRECT
``pwrite``/``pread`` loop over a separate file of the same size with the
same request size, in the same run.

``store`` is put_from/get_into through a real master and node daemon with a
disk tier (objects on disk only, batch 1, default master settings). After
each store read pass, the very ranges it read are read again from the segment
file in the same order with a plain O_DIRECT ``pread`` loop, cold
(``store-disk``): the limit of the store's reads. ``store-offload`` puts 4x
the node's memory as memory objects (eviction offloads them to disk
meanwhile; waits for space included) and reads them all back. It starts once
the master holds no space of the earlier passes' forced removals (their
read leases end first; trees without STATS ``held_bytes`` freed it at once).

    python scripts/bench_tier.py --json out/bench_tier.json [--dir DIR] [--total 128MiB]
        [--rounds 3]

JSON: list of {transport, op, size, batch, gbps, ops_per_s, p50_us, p99_us,
limit, x_limit} (gbps = GB/s, 1e9 bytes; latency = one batch; ``limit`` names
the raw record a measurement is held against, ``x_limit`` the ratio).
Targets: posix >= 0.9x, store reads >= 0.8x.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvpool.core.config import parse_size
from kvpool.transfer import TransferEngine, TransferOp, TransferRequest, load_transfer_config
from kvpool.transfer.file_segment import FileSegment

SIZES = [1 << 20, 16 << 20]
BATCHES = [1, 8]


def _record(transport: str, op: str, size: int, batch: int, lat: list[float]) -> dict[str, Any]:
    total = sum(lat)
    arr = np.array(lat) * 1e6
    return {
        "transport": transport, "op": op, "size": size, "batch": batch,
        "gbps": round(size * batch * len(lat) / total / 1e9, 3) if total else 0.0,
        "ops_per_s": round(batch * len(lat) / total, 1) if total else 0.0,
        "p50_us": round(float(np.percentile(arr, 50)), 1),
        "p99_us": round(float(np.percentile(arr, 99)), 1),
    }


def _aligned(n: int) -> np.ndarray:
    """Page-aligned (anonymous mmap) uint8 buffer, pre-faulted."""
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mm, dtype=np.uint8)
    arr[:] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    return arr


def drop_cache(fd: int) -> str:
    """Drop the page cache for ``fd``'s file; return the method used."""
    os.fsync(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return "fadvise"


Lat = dict[tuple[str, str], list[float]]


def bench_disk(path: str, size: int, batch: int, total: int, buf: np.ndarray,
               acc: Lat) -> None:
    """Plain O_DIRECT pwrite/pread loop: the disk limit."""
    n_ops = max(1, total // (size * batch))
    span = size * batch * n_ops
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, span)
        for op in ("write", "read"):
            if op == "read":
                drop_cache(fd)
            lat: list[float] = []
            for k in range(n_ops):
                t0 = time.perf_counter()
                for j in range(batch):
                    pos = (k * batch + j) * size
                    mv = buf[j * size:(j + 1) * size].data
                    if op == "write":
                        os.pwritev(fd, [mv], pos)
                    else:
                        os.preadv(fd, [mv], pos)
                if op == "write" and k == n_ops - 1:
                    os.fdatasync(fd)
                lat.append(time.perf_counter() - t0)
            acc.setdefault(("disk", op), []).extend(lat)
    finally:
        os.close(fd)
        os.unlink(path)


def bench_engine(engine: TransferEngine, seg: FileSegment, transport: str, label: str,
                 size: int, batch: int, total: int, buf: np.ndarray, acc: Lat,
                 buf_shift: int = 0) -> None:
    n_ops = max(1, min(total // (size * batch), seg.size // (size * batch)))
    for op in (TransferOp.WRITE, TransferOp.READ):
        if op is TransferOp.READ:
            drop_cache(seg.io.fd)
        lat: list[float] = []
        for k in range(n_ops):
            reqs = [TransferRequest(op, buf, seg.segment_id, (k * batch + j) * size, size,
                                    buffer_offset=buf_shift + j * size, transport=transport)
                    for j in range(batch)]
            t0 = time.perf_counter()
            st = engine.transfer(reqs, timeout=120)
            if op is TransferOp.WRITE and k == n_ops - 1:
                seg.sync()
            lat.append(time.perf_counter() - t0)
            bad = [s for s in st if not s.ok]
            if bad:
                raise RuntimeError(f"{label} {op.name} failed: {bad[0].errors}")
        acc.setdefault((label, op.name.lower()), []).extend(lat)


def _wait_zero(m: Any, counter: str, what: str, timeout: float) -> float:
    """Wait until the master's STATS ``counter`` is 0 (or missing: a tree
    without it); the seconds waited. Past ``timeout`` it says ``what`` is
    still there and returns (the measurement goes on)."""
    from kvpool.core.protocol import Stats

    t0 = time.monotonic()
    with m.client() as mc:
        while mc.call(Stats()).as_dict().get(counter, 0):
            if time.monotonic() - t0 > timeout:
                print(f"# {what} still there; measuring anyway", file=sys.stderr)
                break
            time.sleep(0.05)
    return time.monotonic() - t0


def _wait_tasks(m: Any) -> None:
    """Wait until the master has no tier task in flight (promotions copied)."""
    _wait_zero(m, "tier_tasks_inflight", "tier tasks in flight", 60.0)


def _wait_held(m: Any) -> float:
    """Wait until the master holds no removed object's space for its readers
    (STATS ``held_bytes``); the seconds waited."""
    return _wait_zero(m, "held_bytes", "space held for readers", 30.0)


def _disk_offsets(m: Any, keys: list[str]) -> list[int]:
    """File offsets (absolute) of each key's disk replica."""
    from kvpool.core.protocol import BatchGetReplicaList, SegmentKind

    out = []
    with m.client() as mc:
        res = mc.call(BatchGetReplicaList(keys))
    for key, code, reps in zip(keys, res.codes, res.replicas, strict=True):
        if code:
            raise RuntimeError(f"{key}: code {code}")
        for r in reps:
            desc = res.segments[r.segment_id]
            if desc.kind is SegmentKind.FILE:
                out.append(desc.base_offset + r.offset)
                break
        else:
            raise RuntimeError(f"{key} has no disk replica")
    return out


def _raw_reads(path: str, offsets: list[int], size: int, buf: np.ndarray,
               fd_cache: int) -> list[float]:
    """O_DIRECT pread of each range of ``path`` in order (cold): the raw
    read of the very ranges the store just read."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        drop_cache(fd_cache)
        lat = []
        mv = buf[:size].data
        for off in offsets:
            t0 = time.perf_counter()
            os.preadv(fd, [mv], off)
            lat.append(time.perf_counter() - t0)
        return lat
    finally:
        os.close(fd)


def bench_store(base: str, sizes: list[int], total: int, rounds: int, buf: np.ndarray,
                acc_by_size: dict[int, Lat], memory: int) -> None:
    """put_from/get_into through the store (master + node daemon with a disk
    tier, objects on disk only) from this process; reads cold, the master's
    tier settings at their defaults (a promotion it queues runs during the
    reads). After each store read pass, the same ranges of the segment file
    in the same order through a plain O_DIRECT loop, also cold
    (``store-disk``): the limit the store's reads are held against."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.core.protocol import Stats
    from kvpool.store import Client, ClientConfig, ReplicateConfig
    from kvpool.store.errors import NoSpace

    disk_dir = os.path.join(base, "store-disk")
    path = os.path.join(disk_dir, "kvpool-segment.kvseg")
    disk_cfg = ReplicateConfig(replica_num=0, disk_replica_num=1)
    # + what the passes remove by force: a removed object's space stays held
    # while its read leases run (docs/BENCHMARKS.md, known limits), so the
    # offload pass must not count on it
    need = max(sizes) * max(1, total // min(sizes)) + len(sizes) * rounds * total \
        + 4 * memory + (64 << 20)
    with MasterProcess(data_dir=os.path.join(base, "master")) as m, \
            NodeDaemonProcess(m.address, memory, extra_args=[
                "--disk-dir", disk_dir, "--disk", str(max(need, 2 * total))]), \
            Client(ClientConfig(master_address=m.address)) as c:
        fd = os.open(path, os.O_RDONLY)
        try:
            h = c.register_buffer(buf)
            for size in sizes:
                n = max(1, total // size)
                acc = acc_by_size.setdefault(size, {})
                for r in range(rounds):
                    keys = [f"b{size}-{r}-{i}" for i in range(n)]
                    lat: list[float] = []
                    for k in keys:
                        t0 = time.perf_counter()
                        c.put_from(k, buf[:size].data, disk_cfg)
                        lat.append(time.perf_counter() - t0)
                    acc.setdefault(("store", "write"), []).extend(lat)
                    _wait_tasks(m)
                    drop_cache(fd)
                    lat = []
                    for k in keys:
                        t0 = time.perf_counter()
                        got = c.get_into(k, h)
                        lat.append(time.perf_counter() - t0)
                        if got != size:
                            raise RuntimeError(f"store get_into {k}: {got}")
                    acc.setdefault(("store", "read"), []).extend(lat)
                    _wait_tasks(m)  # promotions done: the disk is idle again
                    offsets = _disk_offsets(m, keys)
                    _wait_tasks(m)
                    acc.setdefault(("store-disk", "read"), []).extend(
                        _raw_reads(path, offsets, size, buf, fd))
                    c.remove_all(force=True)
            # the passes' forced removals hold their space while the last
            # reads' leases run: start from an empty pool, as a tree that
            # freed it at once did (else every put below spills to disk)
            held_wait = _wait_held(m)
            # memory replicas only, 4x the node's memory: eviction offloads
            # to the disk tier while puts continue (NoSpace waits are inside the timing)
            size = min(sizes)
            acc = acc_by_size.setdefault(size, {})
            keys = [f"o{size}-{i}" for i in range(4 * memory // size)]
            lat = []
            waits = 0
            for k in keys:
                t0 = time.perf_counter()
                while True:
                    try:
                        c.put_from(k, buf[:size].data)
                        break
                    except NoSpace:
                        waits += 1
                        time.sleep(0.005)
                lat.append(time.perf_counter() - t0)
            acc.setdefault(("store-offload", "write"), []).extend(lat)
            _wait_tasks(m)
            drop_cache(fd)
            lat = []
            for k in keys:
                t0 = time.perf_counter()
                c.get_into(k, h)
                lat.append(time.perf_counter() - t0)
            acc.setdefault(("store-offload", "read"), []).extend(lat)
            with m.client() as mc:
                st = mc.call(Stats()).as_dict()
            print(f"# store-offload: waited {held_wait:.1f} s for held space; "
                  f"{waits} NoSpace waits while offloading; master: "
                  f"{st.get('spilled', 0)} puts spilled to disk (of all passes), "
                  f"{st.get('offload_started', 0)} offloads, "
                  f"{st.get('copy_ahead_started', 0)} copies ahead", file=sys.stderr)
        finally:
            os.close(fd)


def _add_limits(records: list[dict[str, Any]]) -> None:
    """Give each measured record ``limit`` (the raw O_DIRECT loop it is held
    against: ``disk`` of the same size and batch; for store reads
    ``store-disk``, the very ranges they read) and ``x_limit`` (the ratio)."""
    raw = {(r["transport"], r["op"], r["size"], r["batch"]): r for r in records
           if r["transport"] in ("disk", "store-disk")}
    for r in records:
        if r["transport"] in ("disk", "store-disk"):
            continue
        key = (r["op"], r["size"], r["batch"])
        lim = raw.get(("disk", *key))
        if r["transport"] == "store" and r["op"] == "read":
            lim = raw.get(("store-disk", *key), lim)
        if lim is not None and lim["gbps"]:
            r["limit"] = lim["transport"]
            r["x_limit"] = round(r["gbps"] / lim["gbps"], 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--dir", default=None, help="directory on the disk to test "
                    "(default: a temp dir under /var/tmp)")
    ap.add_argument("--total", default="128MiB", help="bytes moved per measurement and round")
    ap.add_argument("--sizes", default="1MiB,16MiB")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per point")
    ap.add_argument("--no-store", action="store_true", help="skip the store (master+daemon)")
    ap.add_argument("--store-memory", default="128MiB",
                    help="the store daemon's memory (store-offload writes 4x this)")
    ap.add_argument("--no-buffered", action="store_true", help="skip posix-buffered")
    args = ap.parse_args(argv)
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    base = tempfile.mkdtemp(prefix="kvpool-bench-tier-", dir=args.dir or "/var/tmp")
    max_span = max(s * b for s in sizes for b in batches)
    seg_size = max(total, max_span)
    records: list[dict[str, Any]] = []
    buf = _aligned(max_span + 4096)
    engine = TransferEngine(load_transfer_config(), "bench-host")
    seg = FileSegment.open(base, seg_size)
    try:
        engine.add_local_segment(seg)
        transports = ["posix"]
        if engine.transports().get("gds", (False, ""))[0]:
            transports.append("gds")
        else:
            print(f"# gds skipped: {engine.transports().get('gds', (False, 'n/a'))[1]}",
                  file=sys.stderr)
        method = drop_cache(seg.io.fd)
        print(f"# cold reads via {method}; dir {base}; O_DIRECT "
              f"{'on' if seg.io.has_direct else 'off: ' + seg.io.direct_reason}",
              file=sys.stderr)
        for size in sizes:
            for batch in batches:
                # rounds alternate limit and engine so both see the same disk weather
                acc: Lat = {}
                for _ in range(args.rounds):
                    bench_disk(os.path.join(base, "limit.dat"), size, batch, total, buf, acc)
                    for t in transports:
                        bench_engine(engine, seg, t, t, size, batch, total, buf, acc)
                    if not args.no_buffered:
                        bench_engine(engine, seg, "posix", "posix-buffered", size, batch,
                                     total, buf, acc, buf_shift=1)
                records += [_record(label, op, size, batch, lat)
                            for (label, op), lat in acc.items()]
        if not args.no_store:
            store_acc: dict[int, Lat] = {}
            bench_store(base, sizes, total, args.rounds, buf, store_acc,
                        parse_size(args.store_memory))
            records += [_record(label, op, size, 1, lat) for size, acc in store_acc.items()
                        for (label, op), lat in acc.items()]
    finally:
        engine.close()
        seg.close()
        shutil.rmtree(base, ignore_errors=True)
    _add_limits(records)
    print(f"{'transport':<20} {'op':<6} {'size':>9} {'batch':>5} {'GB/s':>7} {'ops/s':>8} "
          f"{'p50_us':>9} {'p99_us':>9} {'x limit':>7}  limit")
    for r in records:
        ratio = f"{r['x_limit']:.2f}" if "x_limit" in r else "-"
        print(f"{r['transport']:<20} {r['op']:<6} {r['size']:>9} {r['batch']:>5} "
              f"{r['gbps']:>7.2f} {r['ops_per_s']:>8.0f} {r['p50_us']:>9.0f} "
              f"{r['p99_us']:>9.0f} {ratio:>7}  {r.get('limit', '')}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

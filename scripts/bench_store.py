#!/usr/bin/env python
"""Store benchmark: master + holder daemon + putter process + getter process.

For each transport (shm, then tcp forced by a selector override), value size
(4 KiB, 64 KiB, 1 MiB, 16 MiB) and op (put, get, put_from, get_into and the
batch forms with batch 32) the putter writes into the holder's segment and the
getter reads it back; both are pure clients in their own processes. numpy
memcpy and a raw loopback TCP socket (request/response of the same sizes,
another process) are measured in the same run as the limits.

Writes a JSON list of records ``{transport, op, size, batch, gbps, ops_per_s,
p50_us, p99_us}`` (limits have transport ``memcpy`` / ``socket``), prints a
table and the targets:

- 16 MiB shm get_into >= 0.7x memcpy; 16 MiB tcp get_into >= 0.8x socket;
- 4 KiB shm batch (batch_get_into / batch_put_from) >= 100k keys/s;
- single 4 KiB shm put p50 <= 80 us.

    .venv/bin/python scripts/bench_store.py --json out/bench_store.json [--plot out/bench_store.png]
    .venv/bin/python scripts/bench_store.py --mode multi-buffer --json out/bench_mb.json

``--mode multi-buffer``: Mooncake's ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` against ``batch_put_from`` /
``batch_get_into`` of the same bytes (32 keys x 8 parts of 4 KiB and 1 MiB)
through the Mooncake-compatible class; multi-buffer records carry
``ratio_multi_to_single`` (GB/s over the whole run) and
``ratio_p50_multi_to_single`` (by median call time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
SINGLE_OPS = ["put", "get", "put_from", "get_into"]
BATCH_OPS = ["put_batch", "get_batch", "batch_put_from", "batch_get_into"]
FORCE_TCP = {"rules": [{"name": "bench-force-tcp", "transports": ["tcp"]}]}
WRITE_OF = {"get": "put", "get_into": "put_from", "get_batch": "put_batch",
            "batch_get_into": "batch_put_from"}


def _iters(size: int, budget_bytes: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, budget_bytes // size))


def _record(transport: str, op: str, size: int, batch: int, lat: list[float],
            total_s: float) -> dict[str, Any]:
    keys = len(lat) * batch
    lat_sorted = sorted(lat)
    p99 = lat_sorted[min(len(lat_sorted) - 1, round(0.99 * (len(lat_sorted) - 1)))]
    return {"transport": transport, "op": op, "size": size, "batch": batch,
            "gbps": round(keys * size / total_s / 1e9, 4),
            "ops_per_s": round(keys / total_s, 1),
            "p50_us": round(statistics.median(lat) * 1e6, 1),
            "p99_us": round(p99 * 1e6, 1)}


# ----------------------------------------------------------------------------- workers

def _worker(conn: Connection, master: str) -> None:
    """A pure client in its own process, driven over ``conn``.

    Commands: ("run", transport, op, size, batch, n, tag) -> record;
    ("quit",) -> None.
    """
    from kvpool.core.config import setup_logging
    from kvpool.store import Client, ClientConfig

    setup_logging("WARNING")
    clients: dict[str, Client] = {}
    bufs: dict[tuple[int, int], tuple[list[np.ndarray], list[Any]]] = {}

    def client(transport: str) -> Client:
        if transport not in clients:
            over = FORCE_TCP if transport == "tcp" else {}
            c = Client(ClientConfig(master_address=master, transfer_overrides=over)).setup()
            for i in range(200):  # warm-up: RPC path (local socket switch), caches
                c.exists(f"bench-warmup/{i}")
            clients[transport] = c
        return clients[transport]

    def buffers(c: Client, size: int, batch: int) -> tuple[list[np.ndarray], list[Any]]:
        if (size, batch) not in bufs:
            arrs = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
                    for i in range(batch)]
            bufs[(size, batch)] = (arrs, [c.register_buffer(a) for a in arrs])
        return bufs[(size, batch)]

    try:
        while True:
            msg = conn.recv()
            if msg[0] == "quit":
                break
            _, transport, op, size, batch, n, tag = msg
            c = client(transport)
            arrs, handles = buffers(c, size, batch)
            values = [a.tobytes() for a in arrs] if op in ("put", "put_batch") else []
            lat: list[float] = []
            t0 = time.perf_counter()
            for i in range(n):
                keys = [f"{tag}/{i}/{j}" for j in range(batch)]
                t = time.perf_counter()
                if op == "put":
                    c.put(keys[0], values[0])
                elif op == "put_from":
                    c.put_from(keys[0], handles[0])
                elif op == "get":
                    c.get(keys[0])
                elif op == "get_into":
                    c.get_into(keys[0], handles[0])
                elif op == "put_batch":
                    codes = c.put_batch(keys, values)
                    assert all(x == 0 for x in codes), codes
                elif op == "batch_put_from":
                    codes = c.batch_put_from(keys, handles)
                    assert all(x == 0 for x in codes), codes
                elif op == "get_batch":
                    out = c.get_batch(keys)
                    assert all(o is not None for o in out)
                elif op == "batch_get_into":
                    res = c.batch_get_into(keys, handles)
                    assert all(r == size for r in res), res
                lat.append(time.perf_counter() - t)
            total = time.perf_counter() - t0
            conn.send(_record(transport, op, size, batch, lat, total))
    except Exception as exc:  # report to the driver instead of hanging it
        conn.send({"error": repr(exc)})
    finally:
        for c in clients.values():
            c.close()


def _socket_server(port_conn: Connection) -> None:
    """Raw loopback TCP: for each 8-byte length request, send that many bytes."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_conn.send(srv.getsockname()[1])
    s, _ = srv.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(max(SIZES)))
    while True:
        hdr = s.recv(8, socket.MSG_WAITALL)
        if len(hdr) < 8:
            break
        n = int.from_bytes(hdr, "little")
        s.sendall(payload[:n])
    s.close()
    srv.close()


def _memcpy(size: int) -> dict[str, Any]:
    n = _iters(size, 256 << 20, 20, 2000)
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        np.copyto(dst, src)
        lat.append(time.perf_counter() - t)
    return _record("memcpy", "copy", size, 1, lat, time.perf_counter() - t0)


def _memcpy_cold(size: int, working_set: int = 512 << 20) -> dict[str, Any]:
    """numpy memcpy of ``size`` bytes rotating over a working set larger than
    the CPU caches (as the store's copies are: each key lives elsewhere in the
    segment), op "copy_cold"; the hot ``_memcpy`` copies one cache-resident pair."""
    slots = max(2, working_set // max(size, 1))
    n = _iters(size, 256 << 20, 20, 2000)
    src = np.random.default_rng(0).integers(0, 256, size * slots, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    lat = []
    t0 = time.perf_counter()
    for i in range(n):
        a = (i * 7919 % slots) * size
        t = time.perf_counter()
        np.copyto(dst[a:a + size], src[a:a + size])
        lat.append(time.perf_counter() - t)
    return _record("memcpy", "copy_cold", size, 1, lat, time.perf_counter() - t0)


class _RawSocket:
    """A raw loopback TCP peer in another process: send 8-byte length, get that many bytes."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        self.proc = ctx.Process(target=_socket_server, args=(b,), daemon=True)
        self.proc.start()
        port = a.recv()
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(max(SIZES)))

    def measure(self, size: int) -> dict[str, Any]:
        n = _iters(size, 256 << 20, 20, 2000)
        lat = []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            self.sock.sendall(size.to_bytes(8, "little"))
            got = 0
            while got < size:
                got += self.sock.recv_into(self.buf[got:size])
            lat.append(time.perf_counter() - t)
        return _record("socket", "roundtrip", size, 1, lat, time.perf_counter() - t0)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)


# ----------------------------------------------------------------------------- driver

def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.core.config import parse_size
    from kvpool.core.protocol import RemoveAll

    records: list[dict[str, Any]] = []
    raw = _RawSocket()
    ctx = mp.get_context("spawn")
    holder_bytes = parse_size(args.holder_memory)
    with MasterProcess() as master, \
            NodeDaemonProcess(master.address, holder_bytes) as _holder, \
            master.client(timeout_s=30) as mc:
        pipes: dict[str, Connection] = {}
        procs = []
        for role in ("putter", "getter"):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(b, master.address), name=role, daemon=True)
            p.start()
            pipes[role] = a
            procs.append(p)

        def ask(role: str, *cmd: Any) -> dict[str, Any]:
            pipes[role].send(("run", *cmd))
            if not pipes[role].poll(args.op_timeout):
                raise TimeoutError(f"{role} did not answer {cmd[:5]}")
            rec: dict[str, Any] = pipes[role].recv()
            if "error" in rec:
                raise RuntimeError(f"{role} {cmd[:5]}: {rec['error']}")
            return rec

        try:
            for size in args.sizes:
                # the limits right before the store runs of the same size: this
                # shared 2-core box's load changes from minute to minute
                for rec in (_memcpy(size), _memcpy_cold(size), raw.measure(size)):
                    records.append(rec)
                    _show(rec)
                for transport in args.transports:
                    for batch, ops in ((1, SINGLE_OPS), (args.batch, BATCH_OPS)):
                        n = _iters(size * batch, args.bytes_per_op, 3, args.max_iters)
                        n = max(3, n // batch) if batch > 1 and size < (64 << 10) else n
                        # every key a read measurement asks for must still be stored
                        n = max(1, min(n, int(0.8 * holder_bytes) // (size * batch)))
                        for op in ops:
                            if op in WRITE_OF:  # read back what its write form stored
                                tag = f"{transport}/{WRITE_OF[op]}/{size}/{batch}"
                                rec = ask("getter", transport, op, size, batch, n, tag)
                            else:
                                mc.call(RemoveAll(force=True))
                                tag = f"{transport}/{op}/{size}/{batch}"
                                rec = ask("putter", transport, op, size, batch, n, tag)
                            records.append(rec)
                            _show(rec)
        finally:
            for a in pipes.values():
                try:
                    a.send(("quit",))
                except OSError:
                    pass
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            raw.close()
    records.sort(key=lambda r: (["memcpy", "socket", "shm", "tcp"].index(r["transport"])
                                if r["transport"] in ("memcpy", "socket", "shm", "tcp") else 9))
    return records


# ----------------------------------------------------------------------------- multi-buffer mode
# Mooncake's batch_put_from_multi_buffers / batch_get_into_multi_buffers (the
# calls vLLM's and SGLang's Mooncake connectors make on every save and load)
# against the single-buffer batch calls moving the same bytes: 32 keys x 8
# parts of 4 KiB and 1 MiB, through the Mooncake-compatible class.

MB_KEYS, MB_PARTS = 32, 8
# each write form right before its read form: a write call empties the pool first
MB_OPS = ("batch_put_from", "batch_get_into",
          "batch_put_from_multi_buffers", "batch_get_into_multi_buffers")


def _mb_worker(conn: Connection, master: str) -> None:
    """A pure Mooncake-compatible store in its own process, driven over ``conn``:
    ("run", transport, op, part, n, tag) -> record; ("quit",)."""
    from kvpool.core.config import setup_logging
    from kvpool.store.mooncake import MooncakeDistributedStore

    setup_logging("WARNING")
    stores: dict[str, MooncakeDistributedStore] = {}
    arrays: dict[int, np.ndarray] = {}
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "quit":
                break
            _, transport, op, part, n, tag = msg
            if transport not in stores:
                st = MooncakeDistributedStore()
                conf = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": 0, "local_buffer_size": "16MB",
                        "master_server_address": master}
                if transport == "tcp":
                    conf["transfer_overrides"] = FORCE_TCP
                rc = st.setup(conf)
                assert rc == 0, rc
                stores[transport] = st
            st = stores[transport]
            if part not in arrays:  # one registered region per part size
                arrays[part] = np.random.default_rng(part).integers(
                    0, 256, MB_KEYS * MB_PARTS * part, dtype=np.uint8)
                assert st.register_buffer(int(arrays[part].ctypes.data),
                                          arrays[part].nbytes) == 0
            base = int(arrays[part].ctypes.data)
            whole = MB_PARTS * part
            # part j of every key in region j (vLLM: one region per layer and K/V),
            # so a key's parts are never adjacent in memory
            ptrs = [[base + (j * MB_KEYS + k) * part for j in range(MB_PARTS)]
                    for k in range(MB_KEYS)]
            sizes = [[part] * MB_PARTS for _ in range(MB_KEYS)]
            lat: list[float] = []
            total = 0.0
            for _ in range(n):
                write = op.startswith("batch_put")
                keys = [f"{tag}/{k}" for k in range(MB_KEYS)]
                if write:
                    st.remove_all(True)  # untimed: room for this call's keys (the last
                    # call's stay for the read form of the pair)
                t = time.perf_counter()
                if op == "batch_put_from":  # one buffer per key: the same bytes, contiguous
                    res = st.batch_put_from(keys, [base + k * whole for k in range(MB_KEYS)],
                                            [whole] * MB_KEYS)
                    ok = res == [0] * MB_KEYS
                elif op == "batch_put_from_multi_buffers":
                    res = st.batch_put_from_multi_buffers(keys, ptrs, sizes)
                    ok = res == [0] * MB_KEYS
                elif op == "batch_get_into":
                    res = st.batch_get_into(keys, [base + k * whole for k in range(MB_KEYS)],
                                            [whole] * MB_KEYS)
                    ok = res == [whole] * MB_KEYS
                else:
                    res = st.batch_get_into_multi_buffers(keys, ptrs, sizes)
                    ok = res == [whole] * MB_KEYS
                dt = time.perf_counter() - t
                assert ok, res
                lat.append(dt)
                total += dt
            rec = _record(transport, op, part, MB_KEYS, lat, total)
            rec["gbps"] = round(MB_KEYS * whole * n / total / 1e9, 4)  # bytes of all parts
            rec["parts"] = MB_PARTS
            conn.send(rec)
    except Exception as exc:  # report to the driver instead of hanging it
        conn.send({"error": repr(exc)})
    finally:
        for st in stores.values():
            st.close()


def run_multi_buffer(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both calls of each pair on the same bytes, the write form first (it
    stores what the read form then reads), memcpy of one call's bytes as the
    limit. Adds ``ratio_multi_to_single`` to the multi-buffer records."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.core.config import parse_size

    records: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    with MasterProcess() as master, \
            NodeDaemonProcess(master.address, parse_size(args.holder_memory)):
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_mb_worker, args=(b, master.address), daemon=True)
        proc.start()
        try:
            for part in args.parts:
                rec = _memcpy(MB_KEYS * MB_PARTS * part)
                records.append(rec)
                _show(rec)
                for transport in args.transports:
                    n = _iters(MB_KEYS * MB_PARTS * part, args.bytes_per_op, 3, args.max_iters)
                    got: dict[str, dict[str, Any]] = {}
                    for op in MB_OPS:
                        tag = f"mb/{transport}/{part}/{'multi' if 'multi' in op else 'one'}"
                        a.send(("run", transport, op, part, n, tag))
                        if not a.poll(args.op_timeout):
                            raise TimeoutError(f"{op} {part} {transport}: no answer")
                        rec = a.recv()
                        if "error" in rec:
                            raise RuntimeError(f"{op}: {rec['error']}")
                        got[op] = rec
                    for single, multi in (("batch_put_from", "batch_put_from_multi_buffers"),
                                          ("batch_get_into", "batch_get_into_multi_buffers")):
                        got[multi]["ratio_multi_to_single"] = round(
                            got[multi]["gbps"] / got[single]["gbps"], 3)
                        # the same by median call time (robust to this box's load spikes)
                        got[multi]["ratio_p50_multi_to_single"] = round(
                            got[single]["p50_us"] / got[multi]["p50_us"], 3)
                    for rec in got.values():
                        records.append(rec)
                        _show(rec)
        finally:
            a.send(("quit",))
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    return records


def _show(rec: dict[str, Any]) -> None:
    print(f"  {rec['transport']:6} {rec['op']:15} {rec['size']:>9} x{rec['batch']:<3} "
          f"{rec['gbps']:7.3f} GB/s {rec['ops_per_s']:10.0f} keys/s "
          f"p50 {rec['p50_us']:9.1f} us p99 {rec['p99_us']:9.1f} us", file=sys.stderr)


def _find(records: list[dict[str, Any]], transport: str, op: str, size: int,
          batch: int = 1) -> dict[str, Any] | None:
    for r in records:
        if (r["transport"], r["op"], r["size"], r["batch"]) == (transport, op, size, batch):
            return r
    return None


def targets(records: list[dict[str, Any]], batch: int) -> list[tuple[str, float, float, bool]]:
    """(name, measured, target, ok) for the issue's targets that were measured."""
    out = []
    big = 16 << 20
    mem, sock = _find(records, "memcpy", "copy", big), _find(records, "socket", "roundtrip", big)
    cold = _find(records, "memcpy", "copy_cold", big)
    for op in ("get_into", "put_from"):
        r = _find(records, "shm", op, big)
        if r and mem:
            ratio = r["gbps"] / mem["gbps"]
            out.append((f"16MiB shm {op} / memcpy", ratio, 0.7, ratio >= 0.7))
        if r and cold:
            ratio = r["gbps"] / cold["gbps"]
            out.append((f"16MiB shm {op} / memcpy_cold", ratio, 0.7, ratio >= 0.7))
        r = _find(records, "tcp", op, big)
        if r and sock:
            ratio = r["gbps"] / sock["gbps"]
            out.append((f"16MiB tcp {op} / socket", ratio, 0.8, ratio >= 0.8))
    for op in ("batch_get_into", "batch_put_from"):
        r = _find(records, "shm", op, 4096, batch)
        if r:
            out.append((f"4KiB shm {op} keys/s", r["ops_per_s"], 100000,
                        r["ops_per_s"] >= 100000))
    r = _find(records, "shm", "put", 4096)
    if r:
        out.append(("4KiB shm put p50 us", r["p50_us"], 80, r["p50_us"] <= 80))
    return out


def table(records: list[dict[str, Any]]) -> str:
    head = f"{'transport':9} {'op':15} {'size':>9} {'batch':>5} {'GB/s':>8} {'keys/s':>10} " \
           f"{'p50 us':>9} {'p99 us':>9}"
    lines = [head]
    for r in records:
        lines.append(f"{r['transport']:9} {r['op']:15} {r['size']:>9} {r['batch']:>5} "
                     f"{r['gbps']:8.3f} {r['ops_per_s']:10.0f} {r['p50_us']:9.1f} "
                     f"{r['p99_us']:9.1f}")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'kvpool[plot]'); no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, transport in zip(axes, ("shm", "tcp"), strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in records:
            if r["transport"] == transport:
                series.setdefault(f"{r['op']} (x{r['batch']})", []).append((r["size"], r["gbps"]))
        for lim, style in (("memcpy", "k--"), ("socket", "k:")):
            pts = [(r["size"], r["gbps"]) for r in records if r["transport"] == lim]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), style, label=lim, linewidth=2)
        for name, pts in sorted(series.items()):
            ax.plot(*zip(*sorted(pts), strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("value size (bytes)")
        ax.set_title(f"kvpool store over {transport}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from kvpool.core.config import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write records here")
    p.add_argument("--plot", default=None, help="also draw GB/s by size (needs matplotlib)")
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB",
                   help="comma-separated value sizes")
    p.add_argument("--transports", default="shm,tcp", help="comma-separated: shm,tcp")
    p.add_argument("--batch", type=int, default=32, help="keys per batch call")
    p.add_argument("--bytes-per-op", default="128MiB",
                   help="bytes moved per (transport, size, op) measurement")
    p.add_argument("--max-iters", type=int, default=1000, help="calls per measurement (max)")
    p.add_argument("--holder-memory", default="1GiB", help="memory of the holder daemon")
    p.add_argument("--op-timeout", type=float, default=120.0, help="seconds per measurement")
    p.add_argument("--mode", choices=("store", "multi-buffer"), default="store",
                   help="store: the Client ops above; multi-buffer: Mooncake's multi-buffer "
                   "batch calls against the single-buffer ones (32 keys x 8 parts)")
    p.add_argument("--parts", default="4KiB,1MiB", help="multi-buffer mode: part sizes")
    args = p.parse_args(argv)
    if args.mode == "multi-buffer":
        return _main_multi_buffer(args)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    args.transports = [t for t in args.transports.split(",") if t]
    args.bytes_per_op = parse_size(args.bytes_per_op)
    records = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    print(table(records))
    print()
    for name, val, target, ok in targets(records, args.batch):
        print(f"target {name:32} measured {val:12.2f}  target {target:>8}  "
              f"{'OK' if ok else 'MISSED'}")
    print(f"\nrecords written to {args.json}")
    if args.plot:
        plot(records, args.plot)
    return 0


def _main_multi_buffer(args: argparse.Namespace) -> int:
    from kvpool.core.config import parse_size

    args.parts = [parse_size(s) for s in args.parts.split(",") if s]
    args.transports = [t for t in args.transports.split(",") if t]
    args.bytes_per_op = parse_size(args.bytes_per_op)
    records = run_multi_buffer(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    print(table(records))
    for r in records:
        if "ratio_multi_to_single" in r:
            print(f"{r['transport']:4} {r['op']:30} part {r['size']:>8}: "
                  f"{r['ratio_multi_to_single']:.2f}x the single-buffer call "
                  f"({r['ratio_p50_multi_to_single']:.2f}x by median call time)")
    print(f"\nrecords written to {args.json}")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())

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
table and the targets. The store's records also carry ``client_cpu_us_per_key``
and ``host_steal_pct`` (the share of the VM's CPU time its hypervisor gave to
others during the measurement); two records of transport ``host``, op
``python_loop`` (at the start and the end) time a fixed pure-Python loop, so
runs on machines or days of different speed compare. Targets:

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

Cross-host mode (root; see the "cross-host mode" section below): the holder
in one network namespace, the clients in another, tcp over veth, with
iperf3 / socket-stream limits, TCP retransmits and, optionally, Mooncake
measured the same way in the same run::

    .venv/bin/python scripts/bench_store.py --cross-host --json out/xhost.json \
        [--mooncake /path/to/venv/bin/python] [--link veth] [--rps] [--profile DIR]

Each store record there also says what a call cost from the caller's side
(``phases``): master RPCs and transfer batches per call, the wall time of
each, the rest, and the master ops by type. Single calls of 8 MiB and more
have one more limit, ``xhost_striped_*``: one call after another, each moved
as N stripes over N sockets at once (``--stripes``), what kvpool's striping
of a lone large request can reach in plain Python. ``--tcp-options JSON``
sets the clients' ``transports.tcp.options``; ``--profile-idle`` makes
``--profile`` sample waiting threads too (where a call's wall time goes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from bench_host import host_cpu, process_cpu_s, python_loop_us, steal_pct

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
SINGLE_OPS = ["put", "get", "put_from", "get_into"]
BATCH_OPS = ["put_batch", "get_batch", "batch_put_from", "batch_get_into"]
FORCE_TCP = {"rules": [{"name": "bench-force-tcp", "transports": ["tcp"]}]}
WRITE_OF = {"get": "put", "get_into": "put_from", "get_batch": "put_batch",
            "batch_get_into": "batch_put_from"}


def _iters(size: int, budget_bytes: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, budget_bytes // size))


def python_loop_record(when: str) -> dict[str, Any]:
    """bench_host.python_loop_us as a record (transport "host", op "python_loop",
    p50_us the loop's time): runs on days or minutes of different speed compare
    through it."""
    us = python_loop_us()
    return {"transport": "host", "op": "python_loop", "size": 0, "batch": 1, "gbps": 0.0,
            "ops_per_s": round(1e6 / us, 1), "p50_us": us, "p99_us": us, "when": when}


def _host_info(records: list[dict[str, Any]]) -> list[tuple[str, float, float, bool]]:
    """Info lines (not targets) on the machine during the run: the worst CPU steal
    of a kvpool measurement, and the python_loop time at the start and end."""
    out: list[tuple[str, float, float, bool]] = []
    steals = [r["host_steal_pct"] for r in records if "host_steal_pct" in r]
    if steals:
        out.append(("host CPU stolen, worst measurement % (info)", max(steals), 0.0, True))
    for r in records:
        if r["transport"] == "host" and r["op"] == "python_loop":
            out.append((f"python_loop us at {r['when']} (info)", r["p50_us"], 0.0, True))
    return out


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

class _PhaseClock:
    """Where a client's calls spend their wall time: every master RPC
    (``MasterClient.call``) and every transfer batch (``TransferEngine.run`` /
    ``transfer``) of this process is counted and timed, so a record says how
    many round trips of each kind an op costs and how long they take from the
    caller's side (``phases.other_us``: the op's time outside both; a round
    trip's time includes the peer's handling)."""

    def __init__(self) -> None:
        from kvpool.core.rpc_client import MasterClient
        from kvpool.transfer.engine import TransferEngine

        self.cells: dict[str, list[float]] = {"master": [0, 0.0], "transfer": [0, 0.0]}
        self.by_op: dict[str, int] = {}
        self._wrap(MasterClient, "call", "master")
        self._wrap(TransferEngine, "run", "transfer")
        self._wrap(TransferEngine, "transfer", "transfer")

    def _wrap(self, cls: Any, name: str, cell_name: str) -> None:
        orig = getattr(cls, name)
        cell = self.cells[cell_name]
        by_op = self.by_op
        depth = threading.local()  # a wrapped call inside another counts once

        def timed(obj: Any, *a: Any, **kw: Any) -> Any:
            if getattr(depth, "n", 0):
                return orig(obj, *a, **kw)
            depth.n = 1
            t = time.perf_counter()
            try:
                return orig(obj, *a, **kw)
            finally:
                cell[1] += time.perf_counter() - t
                cell[0] += 1
                depth.n = 0
                if cell_name == "master" and a:
                    op = type(a[0]).__name__
                    by_op[op] = by_op.get(op, 0) + 1

        setattr(cls, name, timed)

    def reset(self) -> None:
        for cell in self.cells.values():
            cell[0], cell[1] = 0, 0.0
        self.by_op.clear()

    def per_op(self, n: int, total_s: float) -> dict[str, Any]:
        m, t = self.cells["master"], self.cells["transfer"]
        return {"phases": {
            "master_rpcs": round(m[0] / n, 3), "master_us": round(m[1] / n * 1e6, 1),
            "transfers": round(t[0] / n, 3), "transfer_us": round(t[1] / n * 1e6, 1),
            "other_us": round((total_s - m[1] - t[1]) / n * 1e6, 1),
            "master_ops": {k: round(v / n, 3) for k, v in sorted(self.by_op.items())}}}


def _worker(conn: Any, master: str, client_kw: dict[str, Any] | None = None) -> None:
    """A pure client in its own process, driven over ``conn``.

    Commands: ("run", transport, op, size, batch, n, tag) -> record;
    ("quit",) -> None. ``client_kw``: extra ClientConfig fields (cross-host mode).
    """
    from kvpool.core.config import setup_logging
    from kvpool.store import Client, ClientConfig

    setup_logging("WARNING")
    phases = _PhaseClock()
    clients: dict[str, Client] = {}
    bufs: dict[tuple[int, int], tuple[list[np.ndarray], list[Any]]] = {}

    def client(transport: str) -> Client:
        if transport not in clients:
            kw = dict(client_kw or {})
            over = {**(FORCE_TCP if transport == "tcp" else {}),
                    **kw.pop("transfer_overrides", {})}
            c = Client(ClientConfig(master_address=master, transfer_overrides=over,
                                    **kw)).setup()
            for i in range(200):  # warm-up: RPC path (local socket switch), caches
                c.exists(f"bench-warmup/{i}")
            clients[transport] = c
        return clients[transport]

    warmed: set[tuple[int, int]] = set()  # (client, size) whose data path is warm
    firsts: dict[tuple[int, int], dict[str, float]] = {}  # its untimed calls' times

    def buffers(c: Client, size: int, batch: int) -> tuple[list[np.ndarray], list[Any]]:
        if (size, batch) not in bufs:
            arrs = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
                    for i in range(batch)]
            bufs[(size, batch)] = (arrs, [c.register_buffer(a) for a in arrs])
        if (id(c), size) not in warmed:
            # one put and get of this size first, not in the op's numbers: a
            # client's first transfers open its connections to the holder (and
            # learn the segment), not the steady state; their times are
            # reported once as first_put_ms / first_get_ms (first contact)
            warmed.add((id(c), size))
            key = f"bench-warmup/{uuid.uuid4().hex[:8]}/{size}"
            handle = bufs[(size, batch)][1][0]
            t = time.perf_counter()
            c.put_from(key, handle)
            t1 = time.perf_counter()
            c.get_into(key, handle)
            t2 = time.perf_counter()
            c.remove(key, force=True)
            firsts[(id(c), size)] = {"first_put_ms": round((t1 - t) * 1e3, 3),
                                     "first_get_ms": round((t2 - t1) * 1e3, 3)}
        return bufs[(size, batch)]

    def measure(transport: str, op: str, size: int, batch: int, n: int,
                tag: str) -> dict[str, Any]:
        c = client(transport)
        arrs, handles = buffers(c, size, batch)
        values = [a.tobytes() for a in arrs] if op in ("put", "put_batch") else []
        lat: list[float] = []
        phases.reset()
        cpu0 = time.process_time()  # every thread of this client process
        host0 = host_cpu()
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
        rec = _record(transport, op, size, batch, lat, total)
        rec.update(firsts.pop((id(c), size), {}))  # on the first record of a client and size
        # client CPU per key (all threads; includes building the key strings)
        rec["client_cpu_us_per_key"] = round(
            (time.process_time() - cpu0) / (n * batch) * 1e6, 2)
        rec["host_steal_pct"] = steal_pct(host0, host_cpu())
        rec.update(phases.per_op(n, total))
        return rec

    try:
        while True:
            msg = conn.recv()
            if msg[0] == "quit":
                break
            try:
                conn.send(measure(*msg[1:]))
            except Exception as exc:  # report it; the next measurement still runs
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
    # by default room for five batches of the largest size: a measurement's puts
    # (at most 0.4 of it, below) beside the last one's objects, removed by force but
    # still under the getter's read leases, and the putter's reservations
    holder_bytes = parse_size(args.holder_memory) if args.holder_memory else \
        max(1 << 30, 5 * max(args.sizes) * args.batch)
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
                        # every key a read measurement asks for must still be stored,
                        # beside the last one's (removed by force, still read-leased)
                        n = max(1, min(n, int(0.4 * holder_bytes) // (size * batch)))
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
            NodeDaemonProcess(master.address, parse_size(args.holder_memory or "1GiB")):
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
          f"p50 {rec['p50_us']:9.1f} us p99 {rec['p99_us']:9.1f} us"
          + (f" cpu {rec['client_cpu_us_per_key']:.1f} us/key"
             if "client_cpu_us_per_key" in rec else "")
          + "".join(f" {r} {rec[f'{r}_cpu_us_per_key']:.1f}" for r in ("master", "holder")
                    if f"{r}_cpu_us_per_key" in rec), file=sys.stderr)
    ph = rec.get("phases")
    if ph:
        print(f"         per call: {ph['master_rpcs']} master RPCs {ph['master_us']} us, "
              f"{ph['transfers']} transfers {ph['transfer_us']} us, rest {ph['other_us']} us "
              f"{ph['master_ops']}", file=sys.stderr)


def _find(records: list[dict[str, Any]], transport: str, op: str, size: int,
          batch: int = 1) -> dict[str, Any] | None:
    """The record of a measurement (None when missing, failed or errored)."""
    for r in records:
        if (r["transport"], r["op"], r["size"], r["batch"]) == (transport, op, size, batch):
            return None if r.get("failed") or r.get("error") else r
    return None


def targets(records: list[dict[str, Any]], batch: int) -> list[tuple[str, float, float, bool]]:
    """(name, measured, target, ok) for the targets (module docstring) that were measured."""
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
    return out + _host_info(records)


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


# ----------------------------------------------------------------------------- cross-host mode
#
# ``--cross-host``: the holder (master + node daemon) runs in network namespace
# "holder", the putter and getter in namespace "client". The two hosts are joined
# the way the chaos suite joins them (tests/support/netns.Topology): each has one
# veth whose peer is a port of a Linux bridge in a third namespace, i.e. two hosts
# on one switch. Every byte therefore takes the tcp transport over real veth
# links. In the same run: iperf3 with XHOST_STREAMS streams in both directions
# (skipped with a message when iperf3 is not installed), a Python socket test
# with the same request sizes over 1 and XHOST_STREAMS connections, a 4 KiB
# socket round trip, and the hosts' TCP counters (retransmits) per measurement.

XHOST_PORT = 50051
XHOST_STREAMS = 2
XHOST_IPERF_PORT = 5201
# TCP counters kept per measurement (deltas over both namespaces)
# (TCPDSACKRecvSegs: retransmitted segments the receiver already had, i.e.
# spurious; TCPSACKReorder / TCPFullUndo: reordering detected, cwnd cut undone)
_TCP_COUNTERS = ("RetransSegs", "TCPLostRetransmit", "TCPTimeouts", "TCPSpuriousRTOs",
                 "TCPFastRetrans", "TCPSlowStartRetrans", "TCPBacklogDrop", "TCPRcvQDrop",
                 "TCPZeroWindowDrop", "TCPRcvPruned", "TCPOFODrop", "TCPDSACKRecv",
                 "TCPDSACKRecvSegs", "TCPDSACKOldSent", "TCPSackRecovery", "TCPSACKReorder",
                 "TCPFullUndo", "TCPLossProbes", "TCPRetransFail", "TCPSpuriousRtxHostQueues",
                 "OutSegs", "InSegs")


class _StdioConn:
    """A worker's end of the driver channel: JSON lines over the real stdout and
    stdin (fd 1 is pointed at stderr so stray output cannot corrupt it)."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    def recv(self) -> Any:
        line = sys.stdin.readline()
        return json.loads(line) if line else ["quit"]

    def send(self, obj: Any) -> None:
        self._out.write(json.dumps(obj) + "\n")
        self._out.flush()


class _NsProc:
    """A helper process in a namespace, asked over JSON lines (see _StdioConn)."""

    def __init__(self, host: Any, argv: list[str], log_path: str) -> None:
        import queue

        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=self._log, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def recv(self, timeout: float) -> Any:
        import queue

        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no answer within {timeout}s; log {self.log_path}") from None
            if line is None:
                raise RuntimeError(f"helper exited ({self.proc.poll()}); log {self.log_path}:"
                                   f"\n{_tail(self.log_path)}")
            if line.startswith(("{", "[")):  # py-spy (--profile) chats on the same stdout
                return json.loads(line)

    def ask(self, *cmd: Any, timeout: float = 120.0) -> Any:
        self.send(*cmd)
        rep = self.recv(timeout)
        if isinstance(rep, dict) and "error" in rep:
            raise RuntimeError(f"{cmd[:5]}: {rep['error']}")
        return rep

    def send(self, *cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(list(cmd)) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._log.close()


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _tcp_counters(host: Any) -> dict[str, int]:
    """The namespace's TCP/IP counters (/proc/net/snmp and /proc/net/netstat
    read from inside it: they are per network namespace)."""
    out: dict[str, int] = {}
    r = host.run(["cat", "/proc/net/snmp", "/proc/net/netstat"], timeout=10)
    lines = r.stdout.splitlines()
    for head, vals in zip(lines[::2], lines[1::2], strict=False):
        names, nums = head.split()[1:], vals.split()[1:]
        for k, v in zip(names, nums, strict=False):
            if k in _TCP_COUNTERS:
                out[k] = out.get(k, 0) + int(v)
    return out


def _softnet_drops() -> int:
    """Packets dropped by full per-CPU input backlogs (veth delivers through
    them; such drops appear on no link's counters). Host-wide."""
    with open("/proc/net/softnet_stat") as f:
        return sum(int(line.split()[1], 16) for line in f if line.strip())


def _link_drops(topo: Any) -> dict[str, int]:
    """Dropped packets on every link of the topology (host veths, bridge ports)."""
    drops: dict[str, int] = {}
    for ns in topo.netns_names():
        r = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show"], capture_output=True,
                           text=True, timeout=10)
        for link in json.loads(r.stdout or "[]"):
            st = link.get("stats64") or link.get("stats") or {}
            n = sum(int(st.get(d, {}).get("dropped", 0)) for d in ("rx", "tx"))
            drops[f"{ns.rsplit('-', 1)[-1]}/{link.get('ifname')}"] = n
    return drops


class _Counters:
    """TCP counter deltas of both namespaces around one measurement (plus the
    host's backlog drops, as ``SoftnetDrops``)."""

    def __init__(self, hosts: list[Any]) -> None:
        self.hosts = hosts
        self.before = [_tcp_counters(h) for h in hosts]
        self.softnet = _softnet_drops()

    def delta(self) -> dict[str, int]:
        out: dict[str, int] = {"SoftnetDrops": _softnet_drops() - self.softnet}
        for h, b in zip(self.hosts, self.before, strict=True):
            for k, v in _tcp_counters(h).items():
                out[k] = out.get(k, 0) + v - b.get(k, 0)
        return {k: v for k, v in out.items() if v}


def _xhost_sockserver() -> None:
    """In the holder namespace: a raw TCP peer for the socket limits. Prints its
    port, then serves each connection in a thread. Request ``op (1 byte) + length
    (8 bytes LE)``: ``W`` the client sends that many bytes, reply 1 byte; ``R``
    reply that many bytes; ``P`` (ping) the client sends that many bytes, reply
    8 bytes."""
    srv = socket.create_server((sys.argv[sys.argv.index("--xhost-sockserver") + 1], 0))
    print(srv.getsockname()[1], flush=True)
    payload = memoryview(bytearray(max(SIZES)))

    def serve(s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_congestion(s, "auto")  # as kvpool's bulk sockets (TransferConfig.tcp_congestion)
        sink = memoryview(bytearray(max(SIZES)))
        with s:
            while True:
                hdr = s.recv(9, socket.MSG_WAITALL)
                if len(hdr) < 9:
                    return
                op, n = hdr[:1], int.from_bytes(hdr[1:], "little")
                if op in (b"W", b"P"):
                    got = 0
                    while got < n:
                        k = s.recv_into(sink[got:n])
                        if not k:
                            return
                        got += k
                    s.sendall(b"k" if op == b"W" else b"pongpong")
                else:
                    s.sendall(payload[:n])

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _xhost_prober() -> None:
    """In the client namespace: socket limits towards the holder and REMOVE_ALL
    at the master, driven over stdin/stdout (_StdioConn)."""
    conn = _StdioConn()
    master = sys.argv[sys.argv.index("--xhost-prober") + 1]
    store: Any = None
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "quit":
                if store is not None:
                    store.close()
                return
            if msg[0] == "remove_all":  # through the store's public API
                if store is None:
                    from kvpool.core.auth import CurveConfig
                    from kvpool.store import Client, ClientConfig

                    store = Client(ClientConfig(master_address=master, host_id="prober",
                                                curve=CurveConfig(enabled=False))).setup()
                conn.send({"removed": store.remove_all(force=True)})
            elif msg[0] == "streams":
                conn.send(_socket_streams(*msg[1:]))
            elif msg[0] == "striped":
                conn.send(_socket_striped(*msg[1:]))
            elif msg[0] == "rtt":
                conn.send(_socket_rtt(*msg[1:]))
            else:
                conn.send({"error": f"unknown command {msg[0]!r}"})
        except Exception as exc:  # report to the driver instead of hanging it
            conn.send({"error": repr(exc)})


def _connect(addr: str, port: int) -> socket.socket:
    s = socket.create_connection((addr, port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_congestion(s, "auto")  # the limit on the congestion control kvpool uses
    return s


def set_congestion(sock: socket.socket, policy: str) -> str:
    """kvpool's :func:`~kvpool.transfer.bulk.set_congestion`, imported on use:
    the Mooncake side runs this script in a venv without kvpool."""
    from kvpool.transfer.bulk import set_congestion as apply

    return apply(sock, policy)


def _kv_congestion() -> str:
    """The congestion control kvpool's bulk sockets get here by default ("" if
    unknown): the limits are measured on the same one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return set_congestion(s, "auto")


def _exchange(s: socket.socket, op: str, payload: memoryview, buf: memoryview, n: int) -> None:
    """One request to the socket server: ``n`` bytes of ``payload`` written
    (op "write") or ``n`` bytes read into ``buf``."""
    s.sendall((b"W" if op == "write" else b"R") + n.to_bytes(8, "little"))
    if op == "write":
        s.sendall(payload[:n])
        s.recv(1, socket.MSG_WAITALL)
        return
    got = 0
    while got < n:
        got += s.recv_into(buf[got:n])


def _socket_streams(addr: str, port: int, streams: int, size: int, seconds: float,
                    op: str) -> dict[str, Any]:
    """``streams`` connections, each doing ``size``-byte W (client -> holder) or R
    (holder -> client) requests back to back for ``seconds``: the link limit of
    request/response traffic as a plain Python program moves it."""
    socks = [_connect(addr, port) for _ in range(streams)]
    payload = memoryview(bytearray(size))
    lat: list[list[float]] = [[] for _ in socks]
    stop = time.perf_counter() + seconds

    def run(i: int) -> None:
        s, buf = socks[i], memoryview(bytearray(max(size, 1)))
        while time.perf_counter() < stop:
            t = time.perf_counter()
            _exchange(s, op, payload, buf, size)
            lat[i].append(time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(socks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = time.perf_counter() - t0
    for s in socks:
        s.close()
    all_lat = [x for part in lat for x in part]
    rec = _record("socket", f"xhost_{op}", size, 1, all_lat, total)
    rec["streams"] = streams
    rec["bytes"] = len(all_lat) * size
    return rec


def _socket_striped(addr: str, port: int, stripes: int, size: int, seconds: float,
                    op: str) -> dict[str, Any]:
    """One ``size``-byte call after another, each moved as ``stripes`` equal
    stripes over as many connections at once (threads meeting at a barrier
    before and after each call): what a single striped call can reach in plain
    Python, where the streams limit keeps every connection busy all the time."""
    socks = [_connect(addr, port) for _ in range(stripes)]
    piece = -(-size // stripes)
    payload = memoryview(bytearray(piece))
    start, end = threading.Barrier(stripes), threading.Barrier(stripes)
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    go = [True]

    def run(i: int) -> None:
        s, buf = socks[i], memoryview(bytearray(piece))
        n = min(piece, size - i * piece)
        while True:
            start.wait()
            if not go[0]:
                return
            t = time.perf_counter()
            _exchange(s, op, payload, buf, n)
            end.wait()
            if i == 0:
                lat.append(time.perf_counter() - t)
                go[0] = time.perf_counter() < stop

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, stripes)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    run(0)
    total = time.perf_counter() - t0
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    rec = _record("socket", f"xhost_striped_{op}", size, 1, lat, total)
    rec["streams"] = stripes
    rec["bytes"] = len(lat) * size
    return rec


def _socket_rtt(addr: str, port: int, size: int, n: int) -> dict[str, Any]:
    """``size`` bytes to the holder and an 8-byte answer, ``n`` times on one
    connection: the floor of one request/reply exchange over the link."""
    s = _connect(addr, port)
    payload = bytes(size)
    hdr = b"P" + size.to_bytes(8, "little")
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        s.sendall(hdr + payload)
        s.recv(8, socket.MSG_WAITALL)
        lat.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    s.close()
    return _record("socket", "xhost_rtt", size, 1, lat, total)


def _xhost_worker() -> None:
    """In the client namespace: the local mode's _worker (a pure store client),
    driven over stdin/stdout, with the host's own id and address and CURVE off
    (the namespaces' addresses are private to this run)."""
    from kvpool.core.auth import CurveConfig

    i = sys.argv.index("--xhost-worker")
    master, host_id, bind, threads, options = sys.argv[i + 1:i + 6]
    kw: dict[str, Any] = {"host_id": host_id, "bind_host": bind,
                          "curve": CurveConfig(enabled=False)}
    tcp: dict[str, Any] = {}
    if int(threads):
        tcp["threads"] = int(threads)
    if json.loads(options):
        tcp["options"] = json.loads(options)
    if tcp:
        kw["transfer_overrides"] = {"transports": {"tcp": tcp}}
    _worker(_StdioConn(), master, kw)


def _iperf3(topo: Any, streams: int, seconds: float, reverse: bool) -> dict[str, Any] | None:
    """iperf3 with ``streams`` parallel streams client -> holder (``reverse``:
    holder -> client); None (with a message) when iperf3 is not installed."""
    import shutil

    if shutil.which("iperf3") is None:
        print("  iperf3 not installed (Debian: apt-get install iperf3): the iperf3 limit is "
              "skipped; the Python socket streams remain the limit", file=sys.stderr)
        return None
    holder, client = topo.host("holder"), topo.host("client")
    cc = _kv_congestion()
    srv = holder.popen(["iperf3", "-s", "-1", "-B", holder.address, "-p",
                        str(XHOST_IPERF_PORT)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    res: dict[str, Any] = {}
    try:
        for _ in range(50):  # until the server listens
            r = client.run(["iperf3", "-c", holder.address, "-p", str(XHOST_IPERF_PORT),
                            "-P", str(streams), "-t", str(seconds), "-J",
                            *(["-C", cc] if cc else []),
                            *(["-R"] if reverse else [])], timeout=seconds + 30)
            try:
                res = json.loads(r.stdout).get("end", {})
            except ValueError:
                res = {}
            if r.returncode == 0 and "sum_received" in res:
                break
            time.sleep(0.1)
        else:
            print(f"  iperf3 failed: {r.stdout[-500:]} {r.stderr[-500:]}", file=sys.stderr)
            return None
    finally:
        topo.kill(srv)
    bps = float(res["sum_received"]["bits_per_second"])
    return {"transport": "iperf3", "op": "xhost_read" if reverse else "xhost_write",
            "size": 0, "batch": 1, "gbps": round(bps / 8e9, 4), "ops_per_s": 0.0,
            "p50_us": 0.0, "p99_us": 0.0, "streams": streams,
            "retrans": int(res.get("sum_sent", {}).get("retransmits", 0)),
            "bytes": int(res["sum_received"].get("bytes", 0))}


def run_cross_host(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cross-host mode (see the section comment): returns the records.

    kvpool (and Mooncake with ``--mooncake``) run side by side on the same two
    hosts; for each size the link's limits are measured first, then kvpool's
    ops, then Mooncake's, so the load of this shared machine skews them alike.
    """
    import shutil
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(os.path.dirname(here), "tests"))
    from support.netns import Topology, cleanup_stale, probe

    cleanup_stale()
    why = probe()
    if why is not None:
        raise SystemExit(f"cross-host mode needs network namespaces: {why}")
    records: list[dict[str, Any]] = []
    work = tempfile.mkdtemp(prefix="kvpool-bench-xhost-")
    # a host id of this run only: its shared memory is found (and removed) by name
    holder_id = f"xhost{os.getpid()}"
    try:
        with Topology(["holder", "client"], direct=args.link == "veth") as topo:
            if args.rps:
                _steer_flows(topo)
            kv = _KvpoolSide(topo, args, work, holder_id)
            mc = _MooncakeSide(topo, args, work) if args.mooncake else None
            try:
                kv.start()
                if mc is not None:
                    mc.start()
                if not args.no_limits:
                    records.append(_show_x(kv.prober.ask("rtt", kv.holder.address,
                                                          kv.sock_port, 4096, 2000)))
                for size in args.sizes:
                    if not args.no_limits:
                        records += _xhost_limits(topo, kv, size, args)
                    records += _xhost_ops(topo, args, "tcp", kv.workers, kv.remove_all,
                                          kv.holder_bytes, size, kv.cpu_pids())
                    if mc is not None:
                        records += _xhost_ops(topo, args, "mooncake", mc.workers,
                                              mc.remove_all, kv.holder_bytes, size)
            finally:
                if mc is not None:
                    mc.stop()
                kv.stop()
            drops = _link_drops(topo)
            records.append({"transport": "links", "op": "dropped", "size": 0, "batch": 1,
                            "gbps": 0.0, "ops_per_s": 0.0, "p50_us": 0.0, "p99_us": 0.0,
                            "mode": "cross-host", "drops": drops})
            print(f"  link drops: {drops}", file=sys.stderr)
    finally:
        _remove_shm(holder_id)
        shutil.rmtree(work, ignore_errors=True)
    return records


def _show_x(rec: dict[str, Any]) -> dict[str, Any]:
    rec["mode"] = "cross-host"
    _show(rec)
    return rec


def _steer_flows(topo: Any) -> None:
    """RPS on every link of the topology: each flow's packets are processed on one
    CPU chosen by its hash, as a NIC's per-flow queue keeps them in order. By
    default veth queues a packet on the sending CPU, so a sender that migrates
    between CPUs mid-stream can reorder its own packets (and TCP retransmits
    segments that were only late: DSACKed, TCPSACKReorder)."""
    mask = format((1 << (os.cpu_count() or 1)) - 1, "x")
    for ns in topo.netns_names():
        r = subprocess.run(["ip", "-n", ns, "-j", "link", "show"], capture_output=True,
                           text=True, timeout=10)
        for link in json.loads(r.stdout or "[]"):
            name = link.get("ifname", "")
            if name and name != "lo" and link.get("link_type") != "loopback":
                subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                                f"echo {mask} > /sys/class/net/{name}/queues/rx-0/rps_cpus"],
                               capture_output=True, timeout=10)


def _wait_file(path: str, what: str, logs: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready:\n" + "\n".join(_tail(f) for f in logs))
        time.sleep(0.05)


class _KvpoolSide:
    """kvpool's master and holder daemon on "holder"; a socket peer for the limits
    beside them; a prober and two store-client workers on "client"."""

    def __init__(self, topo: Any, args: argparse.Namespace, work: str,
                 holder_id: str) -> None:
        from kvpool.core.config import parse_size

        self.topo, self.args, self.work, self.holder_id = topo, args, work, holder_id
        self.holder, self.client = topo.host("holder"), topo.host("client")
        self.master = f"{self.holder.address}:{XHOST_PORT}"
        self.holder_bytes = parse_size(args.holder_memory or "4GiB")
        self.helpers: list[_NsProc] = []
        self.started: list[subprocess.Popen[Any]] = []
        self.daemon: subprocess.Popen[Any] | None = None
        self.workers: dict[str, _NsProc] = {}
        self.sock_port = 0

    def _py(self, role: str) -> list[str]:
        """The interpreter, under ``py-spy record`` with --profile (one file per role)."""
        args = self.args
        if not args.profile:
            return [sys.executable]
        os.makedirs(args.profile, exist_ok=True)
        idle = ["--idle", "--threads"] if args.profile_idle else []
        return [args.py_spy, "record", "--format", "raw", "--rate", str(args.profile_rate),
                "--nonblocking", *idle, "-o",
                os.path.join(os.path.abspath(args.profile), f"{role}.txt"), "--", sys.executable]

    def start(self) -> None:
        me, work, holder = os.path.abspath(__file__), self.work, self.holder
        mlog = open(os.path.join(work, "master.log"), "ab")
        self.started.append(holder.popen(
            [*self._py("master"), "-m", "kvpool.cluster.cli", "--log-level", "WARNING",
             "master", "--host", holder.address, "--port", str(XHOST_PORT), "--metrics-port",
             "0", "--data-dir", os.path.join(work, "data"), "--curve", "off",
             *self.args.master_arg],
            stdout=mlog, stderr=subprocess.STDOUT))
        ready = os.path.join(work, "holder.ready")
        dlog = open(os.path.join(work, "holder.log"), "ab")
        self.daemon = holder.popen(
            [*self._py("holder"), "-m", "kvpool.cluster.cli", "--log-level", "WARNING",
             "client", "--master", self.master, "--memory", str(self.holder_bytes),
             "--host-id", self.holder_id, "--bind-host", holder.address, "--ready-file", ready,
             # (no Mooncake standalone port: --mooncake's master listens on 50052 there)
             "--curve", "off", "--dummy-port", "0", *self._holder_transfer()],
            stdout=dlog, stderr=subprocess.STDOUT)
        self.started.append(self.daemon)
        sock = holder.popen([sys.executable, me, "--xhost-sockserver", holder.address],
                            stdout=subprocess.PIPE, text=True)
        self.started.append(sock)
        assert sock.stdout is not None
        self.sock_port = int(sock.stdout.readline())
        _wait_file(ready, "holder daemon", [os.path.join(work, "holder.log"),
                                             os.path.join(work, "master.log")])
        self.prober = _NsProc(self.client, [sys.executable, me, "--xhost-prober", self.master],
                              os.path.join(work, "prober.log"))
        self.helpers.append(self.prober)
        for role in ("putter", "getter"):
            self.workers[role] = _NsProc(
                self.client, [*self._py(role), me, "--xhost-worker", self.master, "client",
                              self.client.address, str(self.args.tcp_threads),
                              self.args.tcp_options or "{}"],
                os.path.join(work, f"{role}.log"))
            self.helpers.append(self.workers[role])

    def _holder_transfer(self) -> list[str]:
        """``--transfer-config`` of ``--holder-transfer`` (JSON is YAML), or nothing."""
        if not self.args.holder_transfer:
            return []
        path = os.path.join(self.work, "holder_transfer.yaml")
        with open(path, "w") as f:
            f.write(self.args.holder_transfer)
        return ["--transfer-config", path]

    def remove_all(self) -> None:
        self.prober.ask("remove_all")

    def cpu_pids(self) -> dict[str, int]:
        """The master's and the holder daemon's pids (none under --profile:
        py-spy is the process there)."""
        if self.args.profile or self.daemon is None:
            return {}
        return {"master": self.started[0].pid, "holder": self.daemon.pid}

    def stop(self) -> None:
        """Stop everything it started (a clean SIGTERM first for the holder)."""
        import signal

        for h in self.helpers:
            h.close()
        if self.args.profile:  # py-spy writes its file on SIGINT
            for p in self.started:
                self.topo.kill(p, signal.SIGINT, wait_s=30)
        if self.daemon is not None:  # a clean stop unmounts and unlinks its segment
            self.topo.kill(self.daemon, signal.SIGTERM, wait_s=20)
        for p in self.started:  # SIGTERM: the master unlinks its local socket file
            self.topo.kill(p, signal.SIGTERM, wait_s=10)


class _MooncakeSide:
    """Mooncake measured the same way (``--mooncake PYTHON``: an interpreter with
    mooncake-transfer-engine installed, ``mooncake_master`` beside it): its master
    and a holder on "holder", two clients on "client", protocol tcp,
    P2PHANDSHAKE metadata. Records have transport "mooncake"."""

    def __init__(self, topo: Any, args: argparse.Namespace, work: str) -> None:
        from kvpool.core.config import parse_size

        self.topo, self.args, self.work = topo, args, work
        self.holder, self.client = topo.host("holder"), topo.host("client")
        self.master = f"{self.holder.address}:{XHOST_PORT + 1}"
        self.holder_bytes = parse_size(args.holder_memory or "4GiB")
        self.helpers: list[_NsProc] = []
        self.started: list[subprocess.Popen[Any]] = []
        self.workers: dict[str, _NsProc] = {}

    def start(self) -> None:
        me, work, mpy = os.path.abspath(__file__), self.work, self.args.mooncake
        master_bin = os.path.join(os.path.dirname(mpy), "mooncake_master")
        self.started.append(self.holder.popen(
            [master_bin, f"--rpc_port={XHOST_PORT + 1}", "--enable_http_metadata_server=false",
             "--metrics_port=19003"], stdout=open(os.path.join(work, "mc-master.log"), "ab"),
            stderr=subprocess.STDOUT))
        ready = os.path.join(work, "mc-holder.ready")
        # twice kvpool's memory: Mooncake's remove_all leaves leased objects (lease
        # TTL) behind, and with the same size its 16 MiB x 32 puts ran out of space
        self.started.append(self.holder.popen(
            [mpy, me, "--xhost-mc-holder", self.holder.address, self.master,
             str(2 * self.holder_bytes), ready],
            stdout=open(os.path.join(work, "mc-holder.log"), "ab"), stderr=subprocess.STDOUT))
        _wait_file(ready, "Mooncake holder", [os.path.join(work, "mc-holder.log"),
                                               os.path.join(work, "mc-master.log")])
        for role in ("putter", "getter"):
            self.workers[role] = _NsProc(self.client, [mpy, me, "--xhost-mc-worker",
                                                       self.master, self.client.address],
                                         os.path.join(work, f"mc-{role}.log"))
            self.helpers.append(self.workers[role])

    def remove_all(self) -> None:
        self.workers["putter"].ask("remove_all")

    def stop(self) -> None:
        for h in self.helpers:
            h.close()
        for p in self.started:
            self.topo.kill(p)


def _xhost_ops(topo: Any, args: argparse.Namespace, transport: str,
               workers: dict[str, _NsProc], remove_all: Any, holder_bytes: int,
               size: int, cpu_pids: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Every op at ``size`` through ``workers`` ("putter" writes, "getter" reads
    back what its write form stored), with the hosts' TCP counters and the CPU
    per key of each process in ``cpu_pids`` (role -> pid: ``ROLE_cpu_us_per_key``)."""
    hosts = [topo.host("holder"), topo.host("client")]
    cpu_pids = cpu_pids or {}
    records = []
    for batch, ops in ((1, SINGLE_OPS), (args.batch, BATCH_OPS)):
        n = _iters(size * batch, args.bytes_per_op, 3, args.max_iters)
        n = max(3, n // batch) if batch > 1 and size < (64 << 10) else n
        n = max(1, min(n, int(0.8 * holder_bytes) // (size * batch)))
        for op in ops:
            if args.ops and op not in args.ops and WRITE_OF.get(op) not in args.ops:
                continue
            if op in WRITE_OF:
                tag = f"x/{WRITE_OF[op]}/{size}/{batch}"
                role = "getter"
            else:
                remove_all()
                tag = f"x/{op}/{size}/{batch}"
                role = "putter"
            ctr = _Counters(hosts)
            cpu0 = {r: process_cpu_s(pid) for r, pid in cpu_pids.items()}
            try:
                rec = workers[role].ask("run", transport, op, size, batch, n, tag,
                                        timeout=args.op_timeout)
            except RuntimeError as exc:  # recorded; the other measurements go on
                print(f"  {transport} {op} {size} x{batch}: {exc}", file=sys.stderr)
                records.append({"transport": transport, "op": op, "size": size,
                                "batch": batch, "gbps": 0.0, "ops_per_s": 0.0,
                                "p50_us": 0.0, "p99_us": 0.0, "mode": "cross-host",
                                "error": str(exc)})
                continue
            for r, pid in cpu_pids.items():  # includes the worker's own setup calls
                rec[f"{r}_cpu_us_per_key"] = round((process_cpu_s(pid) - cpu0[r]) / (n * batch)
                                                   * 1e6, 2)
            rec["tcp"] = ctr.delta()
            rec["retrans"] = rec["tcp"].get("RetransSegs", 0)
            rec["bytes"] = n * batch * size
            records.append(_show_x(rec))
    return records


def _xhost_mc_holder() -> None:
    """In the holder namespace, under Mooncake's interpreter: contribute memory."""
    from mooncake.store import MooncakeDistributedStore

    i = sys.argv.index("--xhost-mc-holder")
    addr, master, size, ready = sys.argv[i + 1:i + 5]
    s = MooncakeDistributedStore()
    rc = s.setup(addr, "P2PHANDSHAKE", int(size), 16 << 20, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"Mooncake holder setup returned {rc}")
    with open(ready, "w") as f:
        f.write("ok")
    threading.Event().wait()


def _xhost_mc_worker() -> None:
    """In the client namespace, under Mooncake's interpreter: the local mode's
    worker protocol (("run", transport, op, size, batch, n, tag) -> record;
    ("remove_all",); ("quit",)) through Mooncake's MooncakeDistributedStore."""
    from mooncake.store import MooncakeDistributedStore

    conn = _StdioConn()
    i = sys.argv.index("--xhost-mc-worker")
    master, addr = sys.argv[i + 1:i + 3]
    s = MooncakeDistributedStore()
    # the local buffer holds get()/get_batch() results and put() staging
    rc = s.setup(addr, "P2PHANDSHAKE", 0, 1 << 30, "tcp", "", master)
    if rc != 0:
        conn.send({"error": f"Mooncake setup returned {rc}"})
        return
    for k in range(200):  # warm-up, as the kvpool worker does
        s.is_exist(f"bench-warmup/{k}")
    bufs: dict[tuple[int, int], list[np.ndarray]] = {}
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "quit":
                break
            if msg[0] == "remove_all":
                conn.send({"removed": s.remove_all()})
                continue
            _, transport, op, size, batch, n, tag = msg
            if (size, batch) not in bufs:
                arrs = [np.random.default_rng(j).integers(0, 256, size, dtype=np.uint8)
                        for j in range(batch)]
                for a in arrs:
                    assert s.register_buffer(a.ctypes.data, a.nbytes) == 0
                bufs[(size, batch)] = arrs
            arrs = bufs[(size, batch)]
            ptrs, sizes = [a.ctypes.data for a in arrs], [size] * batch
            values = [a.tobytes() for a in arrs] if op in ("put", "put_batch") else []
            lat: list[float] = []
            failed = 0  # keys whose call did not succeed (Mooncake returns codes)
            t0 = time.perf_counter()
            for it in range(n):
                keys = [f"{tag}/{it}/{j}" for j in range(batch)]
                t = time.perf_counter()
                if op == "put":
                    failed += s.put(keys[0], values[0]) != 0
                elif op == "put_from":
                    failed += s.put_from(keys[0], ptrs[0], size) != 0
                elif op == "get":
                    failed += len(s.get(keys[0])) != size
                elif op == "get_into":
                    failed += s.get_into(keys[0], ptrs[0], size) != size
                elif op == "put_batch":
                    failed += batch * (s.put_batch(keys, values) != 0)
                elif op == "batch_put_from":
                    failed += sum(x != 0 for x in s.batch_put_from(keys, ptrs, sizes))
                elif op == "get_batch":
                    failed += sum(len(v) != size for v in s.get_batch(keys))
                elif op == "batch_get_into":
                    failed += sum(r != size for r in s.batch_get_into(keys, ptrs, sizes))
                lat.append(time.perf_counter() - t)
            rec = _record(transport, op, size, batch, lat, time.perf_counter() - t0)
            rec["failed"] = failed
            conn.send(rec)
    except Exception as exc:  # report to the driver instead of hanging it
        conn.send({"error": repr(exc)})
    finally:
        s.close()


def _remove_shm(host_id: str) -> None:
    """Remove shared memory the holder of this run left behind (killed, not stopped)."""
    import glob

    for path in glob.glob(f"/dev/shm/kvpool-{host_id}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _xhost_limits(topo: Any, kv: _KvpoolSide, size: int,
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    """The link's limits right before the ops of ``size``: iperf3 both ways (its
    records carry that size) and the Python socket streams of that size."""
    hosts = [topo.host("holder"), topo.host("client")]
    out: list[dict[str, Any]] = []
    for reverse in (False, True):
        ctr = _Counters(hosts)
        rec = _iperf3(topo, XHOST_STREAMS, args.limit_seconds, reverse)
        if rec is not None:
            rec["size"] = size
            rec["tcp"] = ctr.delta()
            rec["retrans"] = rec["tcp"].get("RetransSegs", 0)
            out.append(_show_x(rec))
    socket_limits = [("streams", n) for n in sorted({1, XHOST_STREAMS, *args.streams})]
    if size >= (8 << 20):  # a single call of this size, striped as kvpool's tcp does
        socket_limits += [("striped", n) for n in args.stripes]
    for kind, n in socket_limits:
        for op in ("write", "read"):
            ctr = _Counters(hosts)
            rec = kv.prober.ask(kind, kv.holder.address, kv.sock_port, n, size,
                                min(args.limit_seconds, 2.0), op)
            rec["tcp"] = ctr.delta()
            rec["retrans"] = rec["tcp"].get("RetransSegs", 0)
            out.append(_show_x(rec))
    return out


def xhost_table(records: list[dict[str, Any]]) -> str:
    """The table with the streams and the TCP retransmits (both hosts) of each record."""
    head = f"{'transport':9} {'op':15} {'size':>9} {'batch':>5} {'GB/s':>8} {'keys/s':>10} " \
           f"{'p50 us':>9} {'p99 us':>9} {'streams':>7} {'retrans':>8}"
    lines = [head]
    for r in records:
        if r["transport"] == "links":
            lines.append(f"links dropped: {r['drops']}")
            continue
        bad = f"  FAILED {r['failed']} keys" if r.get("failed") else \
            (f"  ERROR {r['error'][:60]}" if r.get("error") else "")
        lines.append(f"{r['transport']:9} {r['op']:15} {r['size']:>9} {r['batch']:>5} "
                     f"{r['gbps']:8.3f} {r['ops_per_s']:10.0f} {r['p50_us']:9.1f} "
                     f"{r['p99_us']:9.1f} {r.get('streams', ''):>7} {r.get('retrans', ''):>8}"
                     f"{bad}")
    return "\n".join(lines)


def xhost_targets(records: list[dict[str, Any]], batch: int) -> list[tuple[str, float, float,
                                                                           bool]]:
    """(name, measured, target, ok) of the cross-host targets that were measured:
    ratios to what the same run measured (issue 31), absolute rates for information.

    - 16 MiB single and batch calls and a vLLM-shaped batch (32 x 2 MiB), both
      directions: >= 0.9x the fastest socket limit of the same size (iperf3 or
      the Python streams, 2 or more of them);
    - 4 KiB batch calls: >= 2x Mooncake's keys/s; 4 KiB single calls: p50 <= 0.8x
      Mooncake's.
    """
    from kvpool.core.config import exact_size

    out = []
    for size, ops in ((16 << 20, ("batch_put_from", "batch_get_into", "put_from", "get_into")),
                      (2 << 20, ("batch_put_from", "batch_get_into"))):
        for op in ops:
            lim_op = "xhost_read" if "get" in op else "xhost_write"
            r = _find(records, "tcp", op, size, batch if op.startswith("batch") else 1)
            lims = [x for x in records if x["transport"] in ("socket", "iperf3")
                    and x["op"] == lim_op and x["size"] == size and x.get("streams", 1) >= 2
                    and not x.get("error")]
            lim = max(lims, key=lambda x: x["gbps"], default=None)
            if r and lim:
                ratio = r["gbps"] / lim["gbps"]
                times = f" x{batch}" if op.startswith("batch") else ""
                name = f"{exact_size(size)} {op}{times} / fastest link limit"
                out.append((name, ratio, 0.9, ratio >= 0.9))
    for op in ("batch_put_from", "batch_get_into"):
        r = _find(records, "tcp", op, 4096, batch)
        if r:
            out.append((f"4KiB {op} keys/s (info)", r["ops_per_s"], 0.0, True))
            mc = _find(records, "mooncake", op, 4096, batch)
            if mc and mc["ops_per_s"]:
                ratio = r["ops_per_s"] / mc["ops_per_s"]
                out.append((f"4KiB {op} / Mooncake keys/s", ratio, 2.0, ratio >= 2.0))
    for op in ("put", "get", "put_from", "get_into"):
        r = _find(records, "tcp", op, 4096)
        mc = _find(records, "mooncake", op, 4096)
        if r and mc and mc["p50_us"]:
            ratio = r["p50_us"] / mc["p50_us"]
            out.append((f"4KiB {op} p50 / Mooncake's (lower is better)", ratio, 0.8,
                        ratio <= 0.8))
        elif r:
            out.append((f"4KiB {op} p50 us (info)", r["p50_us"], 0.0, True))
    # retransmits per GiB moved: the store's against iperf3's over the same link
    per_gib = {}
    for t in ("tcp", "mooncake", "iperf3"):
        rs = [x for x in records if x["transport"] == t and x.get("bytes")]
        moved = sum(x["bytes"] for x in rs)
        if moved:
            per_gib[t] = sum(int(x.get("retrans", 0)) for x in rs) / (moved / (1 << 30))
    if "tcp" in per_gib:
        ref = per_gib.get("iperf3", per_gib.get("mooncake"))
        out.append(("TCP retransmits per GiB moved (info)", per_gib["tcp"],
                    round(ref, 1) if ref is not None else 0.0,
                    ref is None or per_gib["tcp"] <= 1.5 * ref))
        if "mooncake" in per_gib:
            out.append(("Mooncake retransmits per GiB (info)", per_gib["mooncake"], 0.0, True))
    return out + _host_info(records)


def main(argv: list[str] | None = None) -> int:
    from kvpool.core.config import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="", help="write records here (required to measure)")
    p.add_argument("--medians", nargs="+", default=None, metavar="JSON",
                   help="cross-host: print each target's value in these runs' records "
                        "and its median over them, then exit (nothing is measured)")
    p.add_argument("--plot", default=None, help="also draw GB/s by size (needs matplotlib)")
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB",
                   help="comma-separated value sizes")
    p.add_argument("--transports", default="shm,tcp", help="comma-separated: shm,tcp")
    p.add_argument("--batch", type=int, default=32, help="keys per batch call")
    p.add_argument("--bytes-per-op", default="128MiB",
                   help="bytes moved per (transport, size, op) measurement")
    p.add_argument("--max-iters", type=int, default=1000, help="calls per measurement (max)")
    p.add_argument("--holder-memory", default=None,
                   help="memory of the holder daemon (default the larger of 1GiB and five "
                   "batches of the largest size; cross-host 4GiB: a "
                   "measurement's objects, removed by force while read-leased, keep their "
                   "space until the lease ends, beside the next measurement's)")
    p.add_argument("--op-timeout", type=float, default=120.0, help="seconds per measurement")
    p.add_argument("--mode", choices=("store", "multi-buffer"), default="store",
                   help="store: the Client ops above; multi-buffer: Mooncake's multi-buffer "
                   "batch calls against the single-buffer ones (32 keys x 8 parts)")
    p.add_argument("--parts", default="4KiB,1MiB", help="multi-buffer mode: part sizes")
    p.add_argument("--cross-host", action="store_true",
                   help="holder and clients in two network namespaces (tcp over veth; root)")
    p.add_argument("--limit-seconds", type=float, default=3.0,
                   help="cross-host: seconds per iperf3 / socket-stream limit")
    p.add_argument("--ops", default="", help="cross-host: only these ops (and their reads)")
    p.add_argument("--no-limits", action="store_true", help="cross-host: skip the limits")
    p.add_argument("--profile", default="",
                   help="cross-host: py-spy record every kvpool process into this folder")
    p.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    p.add_argument("--profile-idle", action="store_true",
                   help="--profile: sample waiting threads too, by thread (where the wall "
                        "time of a call goes, not only its CPU)")
    p.add_argument("--profile-rate", type=int, default=200, help="--profile: samples per second")
    p.add_argument("--mooncake", default="",
                   help="cross-host: also measure Mooncake; PYTHON of a venv with "
                        "mooncake-transfer-engine (mooncake_master beside it)")
    p.add_argument("--tcp-threads", type=int, default=0,
                   help="cross-host: the clients' tcp transport threads (0: its default)")
    p.add_argument("--stripes", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[4, 8], help="cross-host: also measure single calls of 8 MiB "
                   "and more striped over this many sockets (comma-separated)")
    p.add_argument("--holder-transfer", default="",
                   help="cross-host: the holder daemon's transfer config, as JSON (e.g. "
                   "'{\"server\": {\"bulk_spin_us\": 300}}')")
    p.add_argument("--tcp-options", default="",
                   help="cross-host: JSON of the clients' transports.tcp.options")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[1, 2, 4], help="cross-host: socket-stream counts of the link limit")
    p.add_argument("--rps", action="store_true",
                   help="cross-host: steer each flow to one CPU (RPS) as a NIC queue would: "
                        "no veth reordering, no spurious retransmits")
    p.add_argument("--link", choices=("bridge", "veth"), default="bridge",
                   help="cross-host: hosts on a Linux bridge (a switch) or one veth pair")
    p.add_argument("--master-arg", action="append", default=[], metavar="FLAG",
                   help="cross-host: one more flag for the master (repeatable), e.g. "
                        "--master-arg=--rpc-spin-us=0")
    args = p.parse_args(argv)
    if args.medians:
        return _print_medians(args.medians, args.batch)
    if not args.json:
        p.error("--json is required")
    if args.mode == "multi-buffer":
        return _main_multi_buffer(args)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    args.transports = [t for t in args.transports.split(",") if t]
    args.bytes_per_op = parse_size(args.bytes_per_op)
    args.ops = [o for o in args.ops.split(",") if o]
    calib = python_loop_record("start")
    records = run_cross_host(args) if args.cross_host else run(args)
    records = [calib, *records, python_loop_record("end")]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    print(xhost_table(records) if args.cross_host else table(records))
    print()
    for name, val, target, ok in (xhost_targets if args.cross_host else targets)(records,
                                                                                args.batch):
        print(f"target {name:32} measured {val:12.2f}  target {target:>8}  "
              f"{'OK' if ok else 'MISSED'}")
    print(f"\nrecords written to {args.json}")
    if args.plot:
        plot(records, args.plot)
    return 0


def _print_medians(paths: list[str], batch: int) -> int:
    """Each cross-host target's value per run (records written by --json) and
    the median over the runs: issue 31's figures are medians of three or more."""
    per: dict[str, list[float]] = {}
    goal: dict[str, tuple[float, bool]] = {}
    for path in paths:
        with open(path) as f:
            records = json.load(f)
        for name, val, target, _ok in xhost_targets(records, batch):
            per.setdefault(name, []).append(val)
            goal[name] = (target, "lower is better" in name)
    for name, vals in per.items():
        med = statistics.median(vals)
        target, lower = goal[name]
        ok = "info" if "(info)" in name else (
            "OK" if (med <= target if lower else med >= target) else "MISSED")
        runs = " ".join(f"{v:.2f}" for v in vals)
        print(f"median {name:50} {med:10.2f}  target {target:>6}  {ok:6}  runs: {runs}")
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


_HELPERS = {"--xhost-worker": _xhost_worker, "--xhost-prober": _xhost_prober,
            "--xhost-sockserver": _xhost_sockserver, "--xhost-mc-holder": _xhost_mc_holder,
            "--xhost-mc-worker": _xhost_mc_worker}

if __name__ == "__main__":
    threading.current_thread().name = "bench"
    helper = next((f for flag, f in _HELPERS.items() if flag in sys.argv[1:2]), None)
    sys.exit(helper() if helper is not None else main())

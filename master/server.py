"""The master server: one event loop on a ZeroMQ ROUTER socket.

Each loop iteration drains up to ``_DRAIN`` requests, handles them against
the :class:`Directory`, group-commits the journal records they produced (one
write, fsync per policy), and only then sends the replies. Timers (client
expiry, purge of dropped segments, pending-put sweep, journal fsync,
snapshots) run between iterations in bounded slices so the loop never stalls.

Snapshots are fuzzy and incremental (journal.py): rotate the journal, then
serialize a few ms of objects per loop iteration; a thread writes the file.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack
import zmq

from kvpool.core import __version__
from kvpool.core.capability import CapabilitySigner, CapOp
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import Op, SegmentDescriptor, SegmentKind, decode_frame, encode_frame
from kvpool.master.config import MasterConfig
from kvpool.master.directory import HARD_PIN, SOFT_PIN, Directory, Pending, SegState
from kvpool.master.journal import (
    Journal,
    SnapshotWriter,
    iter_snapshot,
    list_journals,
    list_snapshots,
    read_journal,
)
from kvpool.master.local_rpc import LocalRpcServer, default_socket_path
from kvpool.master.tiering import TieringPolicy

__all__ = ["MasterServer"]

log = logging.getLogger(__name__)

_DRAIN = 256
_PROCESSING = 0
_COMPLETE = 1
_EMPTY = b""
_CAP_WRITE = int(CapOp.WRITE)
_CAP_READ = int(CapOp.READ)
_time_ns = time.time_ns  # capability expiry is wall-clock epoch ms (it crosses hosts)
_KEYS_FILE = "capability-keys.msgpack"
_FILE = SegmentKind.FILE

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def _bad(msg: str, code: ErrorCode = ErrorCode.INVALID_PARAMS) -> KVPoolError:
    return KVPoolError(msg, code)


def _arg_str(args: dict[str, Any], name: str) -> str:
    v = args.get(name)
    if type(v) is not str or not v:
        raise _bad(f"{name} must be a non-empty string")
    return v


def _arg_bool(args: dict[str, Any], name: str, default: bool = False) -> bool:
    v = args.get(name, default)
    if v is None:
        return default
    if type(v) is not bool:
        raise _bad(f"{name} must be a bool")
    return v


def _peek_id(payload: bytes) -> Any:
    """The request id of an oversized frame (so the client can match the
    error reply), read without decoding the large args; None if not found."""
    try:
        u = msgpack.Unpacker(raw=False, max_buffer_size=len(payload) + 1)
        u.feed(payload)
        for _ in range(u.read_map_header()):
            k = u.unpack()
            if k == "id":
                v = u.unpack()
                return v if type(v) in (int, str) else None
            u.skip()
    except Exception:
        pass
    return None


class MasterServer:
    """Serve the op table of :mod:`kvpool.core.protocol` until ``stop()``.

    Construction binds the sockets (``port`` 0 picks a free one; see
    ``self.port``) and restores state from ``data_dir``.
    """

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.tiering = TieringPolicy(cfg.tiering)  # SSD tier (issue 5)
        self.dir = Directory(cfg, policy=self.tiering)
        self.journal: Journal | None = None
        self._stop = False
        self._snapshot: SnapshotWriter | None = None
        self._snap_requested = False
        self._last_snapshot = time.monotonic()
        self.snapshot_count = 0
        self.last_snapshot_pause_ms = 0.0  # wall time of the loop pause to start one
        self.last_snapshot_pause_cpu_ms = 0.0  # the same in loop-thread CPU time
        self.max_snapshot_step_ms = 0.0
        self.max_snapshot_step_cpu_ms = 0.0
        self.last_snapshot_duration_s = 0.0
        self.max_loop_ms = 0.0
        self.ops: dict[str, int] = {}
        self.key_ops: dict[str, int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.restored_objects = 0
        self.max_key = cfg.max_key_length
        self.max_batch = cfg.max_batch_size
        # issue 7: per-segment keys + signed READ/WRITE capabilities per replica
        self.signer: CapabilitySigner | None = None
        if cfg.capabilities:
            self.signer = CapabilitySigner(cfg.capability_ttl_ms or cfg.lease_ttl_ms)
        self._grant = self.signer.grant_fast if self.signer is not None else None
        # a WRITE grant lasts as long as the put may (a big put over a slow link
        # must not be cut off mid-way); READ grants last a read lease
        self._write_ttl_ms = max(cfg.capability_ttl_ms or cfg.lease_ttl_ms,
                                 int(cfg.put_start_discard_timeout_s * 1000))
        self._keys_dirty = False
        self.too_many_requests = 0
        self._handlers: dict[int, tuple[str, Handler]] = {
            op: (op.name, getattr(self, "_op_" + op.name.lower())) for op in Op
        }
        # The directory is millions of long-lived, cycle-free objects: full GC
        # passes over them would stall the loop for 100s of ms. Collect young
        # objects rarely and freeze survivors (frozen objects are still freed
        # by refcounting; they are just never scanned).
        gc.set_threshold(50000, 50, 1000)
        if cfg.data_dir:
            os.makedirs(cfg.data_dir, exist_ok=True)
            os.chmod(cfg.data_dir, 0o700)  # journal, snapshots and segment keys are secrets
            gc.disable()
            try:
                self._restore()
                self._load_keys()
            finally:
                gc.enable()
        gc.freeze()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # frames up to max_frame_size get a FRAME_TOO_LARGE reply from the decoder;
        # far larger ones make ZeroMQ drop the connection before buffering them
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * cfg.max_frame_size + 4096)
        # back-pressure: a connection's queue is bounded; beyond it ZeroMQ stops
        # reading that peer's TCP stream (see max_inflight_per_client)
        self.sock.setsockopt(zmq.RCVHWM, 4 * cfg.max_inflight_per_client)
        self.sock.setsockopt(zmq.SNDHWM, 100000)
        # CURVE (+ ZAP allow-list) before bind; None when off (loopback default)
        self._auth = cfg.curve.setup_server(self.sock, cfg.host)
        if cfg.port == 0:
            self.port = self.sock.bind_to_random_port(f"tcp://{cfg.host}")
        else:
            self.sock.bind(f"tcp://{cfg.host}:{cfg.port}")
            self.port = cfg.port
        # same-host clients: a Unix socket served from the loop (local_rpc)
        self.local_rpc: LocalRpcServer | None = None
        local = cfg.local_socket
        if local == "auto":
            local = "off" if self._auth is not None else default_socket_path(self.port)
        if local and local != "off":
            try:
                self.local_rpc = LocalRpcServer(local, cfg.max_frame_size)
            except OSError as exc:
                log.warning("no local socket at %s (%s); same-host clients use tcp", local, exc)
        self._http: ThreadingHTTPServer | None = None
        self.metrics_port = 0
        if cfg.metrics_port:
            self._start_http()
        log.info("kvpool master %s listening on tcp://%s:%d (CURVE %s, metrics %s, data_dir %s)",
                 __version__, cfg.host, self.port, "on" if self._auth else "off",
                 self.metrics_port or "off", cfg.data_dir)

    # ================================================================ durability
    def _restore(self) -> None:
        data_dir = self.cfg.data_dir
        assert data_dir
        d = self.dir
        d.journaling = False
        t0 = time.monotonic()
        snap_seq = 0
        for seq, path in reversed(list_snapshots(data_dir)):
            try:
                header, records = iter_snapshot(path)
                d.bulk_load(list(header["segments"]), records)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("ignoring snapshot %s: %s", path, exc)
                # discard what was partly loaded
                d = self.dir = Directory(self.cfg, policy=self.tiering)
                d.journaling = False
                continue
            snap_seq = seq
            break
        for name in os.listdir(data_dir):  # leftovers of a crashed snapshot child
            if ".tmp." in name and name.startswith("snapshot-"):
                os.unlink(os.path.join(data_dir, name))
        last_seq = snap_seq
        replayed = 0
        for seq, path in list_journals(data_dir):
            last_seq = max(last_seq, seq)
            if seq < snap_seq:
                continue
            journal_records, _torn = read_journal(path, truncate=True)
            for rec in journal_records:
                try:
                    d.apply_record(rec)
                except Exception as exc:
                    log.error("journal %s: bad record %r: %s", path, rec[:2], exc)
            replayed += len(journal_records)
        d.finish_restore()
        d.journaling = True
        self.restored_objects = len(d.objects)
        self.journal = Journal(data_dir, last_seq + 1, self.cfg.journal_fsync,
                               self.cfg.journal_fsync_interval_ms / 1000.0)
        if snap_seq or replayed:
            log.info("restored %d segments, %d objects (snapshot %d + %d journal records) in %.2fs",
                     len(d.segments), len(d.objects), snap_seq, replayed, time.monotonic() - t0)

    def request_snapshot(self) -> None:
        """Take a snapshot at the next loop iteration (also SIGUSR1)."""
        self._snap_requested = True

    def _start_snapshot(self) -> None:
        """Rotate the journal and start a fuzzy snapshot (see journal.py)."""
        if self.journal is None or self._snapshot is not None:
            return
        t0 = time.perf_counter()
        c0 = time.thread_time()
        new_seq = self.journal.seq + 1
        old_fd = self.journal.rotate(new_seq, sync=False)
        d = self.dir
        # keys are copied one shard at a time as the snapshot reaches them
        self._snapshot = SnapshotWriter(self.cfg.data_dir or ".", new_seq, d.segment_wires(),
                                        d.objects.key_chunks(), old_fd)
        self.last_snapshot_pause_ms = (time.perf_counter() - t0) * 1000
        self.last_snapshot_pause_cpu_ms = (time.thread_time() - c0) * 1000
        self._last_snapshot = time.monotonic()
        log.info("snapshot %d started (%d objects, pause %.1f ms)", new_seq,
                 len(d.objects), self.last_snapshot_pause_ms)

    def _snapshot_step(self) -> None:
        snap = self._snapshot
        if snap is None:
            return
        t0 = time.perf_counter()
        c0 = time.thread_time()
        snap.step(self.dir.snapshot_record, self.cfg.snapshot_slice_ms / 1000.0)
        step_ms = (time.perf_counter() - t0) * 1000
        if step_ms > self.max_snapshot_step_ms:
            self.max_snapshot_step_ms = step_ms
        step_cpu_ms = (time.thread_time() - c0) * 1000
        if step_cpu_ms > self.max_snapshot_step_cpu_ms:
            self.max_snapshot_step_cpu_ms = step_cpu_ms
        if not snap.done.is_set():
            return
        self._snapshot = None
        self.last_snapshot_duration_s = time.monotonic() - snap.started
        if snap.error is not None:
            log.error("snapshot %d failed: %s; journals kept", snap.seq, snap.error)
            return
        self.snapshot_count += 1
        self._compact(snap.seq)
        log.info("snapshot %d written (%d objects) in %.2fs", snap.seq, snap.count,
                 self.last_snapshot_duration_s)

    def _compact(self, seq: int) -> None:
        """Keep the newest ``snapshot_keep`` snapshots and the journals they need."""
        data_dir = self.cfg.data_dir
        assert data_dir
        snaps = list_snapshots(data_dir)
        keep = snaps[-self.cfg.snapshot_keep:]
        for _s, path in snaps[: len(snaps) - len(keep)]:
            os.unlink(path)
        oldest = keep[0][0] if keep else seq
        for s, path in list_journals(data_dir):
            if s < oldest:
                os.unlink(path)

    # ================================================================ capability keys
    def _keys_path(self) -> str | None:
        return os.path.join(self.cfg.data_dir, _KEYS_FILE) if self.cfg.data_dir else None

    def _load_keys(self) -> None:
        """Restore the segment keys of restored segments (issue 7)."""
        path = self._keys_path()
        if self.signer is None or path is None or not os.path.exists(path):
            return
        try:
            with open(path, "rb") as f:
                keys = msgpack.unpackb(f.read(), raw=False)
            if type(keys) is not dict:
                raise ValueError("not a map")
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            log.error("ignoring %s: %s (segments get new keys when re-mounted)", path, exc)
            return
        self.signer.load_keys({k: v for k, v in keys.items()
                               if k in self.dir.segments and type(v) is bytes})

    def _save_keys(self) -> None:
        """Write every segment key atomically (mode 0600, fsync'ed): rare
        (new mounts and pruning), so done synchronously."""
        path = self._keys_path()
        if self.signer is None or path is None:
            return
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, msgpack.packb(self.signer.keys(), use_bin_type=True))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._keys_dirty = False

    def _prune_keys(self) -> None:
        """Forget the keys of segments the directory no longer has (timer)."""
        signer = self.signer
        if signer is None:
            return
        segs = self.dir.segments
        gone = [sid for sid in signer.keys() if sid not in segs]
        for sid in gone:
            signer.forget(sid)
        if gone:
            try:
                self._save_keys()
            except OSError as exc:
                log.error("cannot write capability keys: %s", exc)

    def _too_many(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply to a request beyond ``max_inflight_per_client`` (not run)."""
        if len(frames) < 2:
            return None
        self.too_many_requests += 1
        key = ("invalid", ErrorCode.TOO_MANY_REQUESTS.name)
        self.errors[key] = self.errors.get(key, 0) + 1
        prefix = frames[:2] if len(frames) == 3 and frames[1] == _EMPTY else frames[:1]
        return [*prefix, self._error_reply(
            _peek_id(frames[-1]), ErrorCode.TOO_MANY_REQUESTS,
            f"more than {self.cfg.max_inflight_per_client} requests queued on this "
            "connection; wait for replies before sending more")]

    # ================================================================ admin HTTP
    def _start_http(self) -> None:
        from kvpool.master.metrics import make_handler, make_registry

        registry = make_registry(self)
        handler: type[BaseHTTPRequestHandler] = make_handler(self, registry)
        self._http = ThreadingHTTPServer((self.cfg.metrics_host, self.cfg.metrics_port), handler)
        self._http.daemon_threads = True
        self.metrics_port = self._http.server_address[1]
        t = threading.Thread(target=self._http.serve_forever, name="kvpool-master-http",
                             daemon=True)
        t.start()

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "version": __version__, "port": self.port,
                "objects": len(self.dir.objects), "segments": len(self.dir.segments),
                "uptime_s": round(time.monotonic() - self.started, 3)}

    # ================================================================ loop
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: stop after the current iteration; SIGUSR1: snapshot."""
        def _stop(signum: int, _frame: Any) -> None:
            log.info("signal %d: shutting down", signum)
            self._stop = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGUSR1, lambda *_: self.request_snapshot())

    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        sock = self.sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        recv = sock.recv_multipart
        send = sock.send_multipart
        handle = self.handle_frames
        inflight_limit = self.cfg.max_inflight_per_client
        journal = self.journal
        d = self.dir
        local = self.local_rpc
        if local is not None:
            local.register(poller)

        def local_too_many(payload: bytes) -> bytes:
            return (self._too_many([b"", payload]) or [b""])[-1]
        next_expiry = next_sweep = next_freeze = time.monotonic()
        while not self._stop:
            timeout = 0 if (d.purge_pending or d.evicting
                            or self._snapshot is not None) else 50
            events = poller.poll(timeout)
            if not events:
                replies: list[list[bytes]] = []
            else:
                t_start = time.perf_counter()
                replies = []
                per_peer: dict[bytes, int] = {}
                for _ in range(_DRAIN):
                    # check EVENTS rather than catching zmq.Again (exceptions are slow)
                    if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                        break
                    frames = recv(zmq.NOBLOCK, copy=True)
                    ident = frames[0]
                    queued = per_peer.get(ident, 0) + 1
                    per_peer[ident] = queued
                    if queued > inflight_limit:
                        out = self._too_many(frames)
                    else:
                        out = handle(frames)
                    if out is not None:
                        replies.append(out)
                local_replies = local.serve(events, self.handle_payload, local_too_many,
                                            inflight_limit) if local is not None else None
                if journal is not None and d.records:
                    journal.append_many(d.records)
                    d.records.clear()
                    journal.commit()  # group commit before any reply leaves
                elif d.records:
                    d.records.clear()
                for r in replies:
                    try:
                        send(r, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # peer gone / HWM: the client times out and retries
                if local_replies:
                    local.send_all(local_replies)  # type: ignore[union-attr]
                loop_ms = (time.perf_counter() - t_start) * 1000
                if loop_ms > self.max_loop_ms:
                    self.max_loop_ms = loop_ms
            now = time.monotonic()
            if d.purge_pending:
                d.purge_step(self.cfg.purge_slice)
            if d.evicting:
                d.evict_step()
            if now >= next_expiry:
                next_expiry = now + 0.1
                d.expire_step()
                self.tiering.tick(d)  # tier task deadlines, kept file segments
            if now >= next_sweep:
                next_sweep = now + 1.0
                d.sweep_pending()
                self._prune_keys()
            if now >= next_freeze:
                next_freeze = now + 1.0
                gc.freeze()  # O(1): moves survivors out of the scanned generations
            if journal is not None:
                if d.records:  # expiry/sweep changes
                    journal.append_many(d.records)
                    d.records.clear()
                    journal.commit()
                journal.maybe_fsync()
                self._snapshot_step()
                if self._snap_requested or (
                        self.cfg.snapshot_interval_s
                        and now - self._last_snapshot >= self.cfg.snapshot_interval_s
                        and journal.records_written >= self.cfg.snapshot_min_journal_records):
                    self._snap_requested = False
                    self._start_snapshot()
            else:
                d.records.clear()
                self._snap_requested = False

    def close(self) -> None:
        """Flush + fsync the journal, wait for a snapshot child, close sockets."""
        if self.journal is not None:
            if self.dir.records:
                self.journal.append_many(self.dir.records)
                self.dir.records.clear()
            self.journal.close()
            if self._snapshot is not None:
                self._snapshot.abort()
                self._snapshot = None
            self.journal = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self.local_rpc is not None:
            self.local_rpc.close()
            self.local_rpc = None
        self.sock.close(0)
        if self._auth is not None:
            self._auth.close()
            self._auth = None
        self.ctx.term()
        log.info("master stopped")

    # ================================================================ dispatch
    def handle_frames(self, frames: list[bytes]) -> list[bytes] | None:
        """One ROUTER message -> the reply frames (None: nothing to answer)."""
        n = len(frames)
        if n == 2:  # DEALER: [identity, payload]
            prefix = frames[:1]
        elif n == 3 and frames[1] == _EMPTY:  # REQ: [identity, "", payload]
            prefix = frames[:2]
        elif n >= 2:
            return [frames[0], self._error_reply(None, ErrorCode.MALFORMED_FRAME,
                                                 f"expected one payload frame, got {n - 1}")]
        else:
            return None
        return [*prefix, self.handle_payload(frames[-1])]

    def _error_reply(self, rid: Any, code: ErrorCode, msg: str) -> bytes:
        return encode_frame({"id": rid, "code": int(code), "result": None, "error": msg})

    def handle_payload(self, payload: bytes) -> bytes:
        """Decode one request, run it, encode the reply. Never raises."""
        rid: Any = None
        name = "invalid"
        try:
            msg = decode_frame(payload, self.cfg.max_frame_size)
            if type(msg) is not dict:
                raise _bad("request must be a map", ErrorCode.MALFORMED_FRAME)
            rid = msg.get("id")
            if rid is not None and type(rid) not in (int, str):
                rid = None
            op = msg.get("op")
            entry = self._handlers.get(op) if type(op) is int else None
            if entry is None:
                name = "unknown"
                raise _bad(f"unknown op {op!r}", ErrorCode.UNKNOWN_OP)
            name, fn = entry
            args = msg.get("args")
            if args is None:
                args = {}
            elif type(args) is not dict:
                raise _bad("args must be a map")
            self.ops[name] = self.ops.get(name, 0) + 1
            result = fn(args)
            return encode_frame({"id": rid, "code": 0, "result": result})
        except KVPoolError as exc:
            code = exc.code
            text = str(exc)
            if code == ErrorCode.FRAME_TOO_LARGE:
                rid = _peek_id(payload)
        except Exception as exc:  # a bug: answer and keep serving
            log.exception("internal error handling %s", name)
            code = ErrorCode.INTERNAL_ERROR
            text = f"{type(exc).__name__}: {exc}"
        key = (name, code.name)
        self.errors[key] = self.errors.get(key, 0) + 1
        try:
            return self._error_reply(rid, code, text[:1000])
        except Exception:
            return self._error_reply(None, code, text[:1000])

    def _count(self, name: str, n: int, results: list[list[Any]]) -> None:
        self.key_ops[name] = self.key_ops.get(name, 0) + n
        errs = self.errors
        for r in results:
            if r[0]:
                k = (name, ErrorCode(r[0]).name)
                errs[k] = errs.get(k, 0) + 1

    # ---------------------------------------------------------------- validation
    def _key(self, key: Any) -> str | None:
        """The key if valid, else None (caller reports INVALID_KEY)."""
        if type(key) is str and key and len(key) <= self.max_key:
            return key
        return None

    def _keys(self, args: dict[str, Any]) -> list[Any]:
        keys = args.get("keys")
        if type(keys) is not list:
            raise _bad("keys must be a list")
        if len(keys) > self.max_batch:
            raise _bad(f"batch of {len(keys)} exceeds max_batch_size {self.max_batch}")
        return keys

    def _one_key(self, args: dict[str, Any]) -> str:
        key = self._key(args.get("key"))
        if key is None:
            raise _bad("key must be a non-empty string of at most "
                       f"{self.max_key} characters", ErrorCode.INVALID_KEY)
        return key

    @staticmethod
    def _raise(code: int, what: str) -> None:
        if code:
            raise KVPoolError(what, code)

    # ---------------------------------------------------------------- segments
    def _op_ping(self, args: dict[str, Any]) -> dict[str, Any]:
        client_id = _arg_str(args, "client_id")
        if _arg_bool(args, "heartbeat"):
            # from the client's guard process: its memory lives (it may be stalled)
            return {"known": self.dir.heartbeat(client_id)}
        remount, ids = self.dir.ping(client_id)
        out: dict[str, Any] = {"remount": remount, "segment_ids": ids}
        if self.tiering.tasks:  # SSD tier: copy tasks this node executes
            tasks, segs = self.tiering.tasks_for(self.dir, client_id)
            if tasks:
                grant = self._grant
                if grant is not None:  # WRITE capability on each task's destination
                    exp = self.signer.expiry(  # type: ignore[union-attr]
                        max(self.signer.ttl_ms,  # type: ignore[union-attr]
                            int(self.cfg.tiering.task_timeout_s * 1000)))
                    for t in tasks:
                        dst = t.get("dst")
                        if isinstance(dst, list) and len(dst) == 2:
                            t["cap"] = grant(dst[0], dst[1], t["size"], _CAP_WRITE, exp)
                out["tasks"] = tasks
                out["segments"] = segs
        return out

    def _op_tier_task_done(self, args: dict[str, Any]) -> dict[str, Any]:
        client_id = _arg_str(args, "client_id")
        task_id = args.get("task_id")
        ok = _arg_bool(args, "ok")
        error = args.get("error", "")
        if type(task_id) is not int or type(error) is not str:
            raise _bad("task_id must be an int and error a string")
        self._raise(self.tiering.complete(self.dir, client_id, task_id, ok, error[:500]),
                    "tier_task_done")
        return {}

    def _op_mount_segment(self, args: dict[str, Any]) -> dict[str, Any]:
        client_id = _arg_str(args, "client_id")
        seg = args.get("segment")
        if type(seg) is not dict:
            raise _bad("segment must be a map")
        desc = SegmentDescriptor.from_wire(seg)
        if desc.size <= 0 or desc.size > 1 << 50:
            raise _bad("segment size out of range")
        signer = self.signer
        prev = self.dir.segments.get(desc.segment_id)
        # re-adoption after a master restart keeps the persisted key (grants
        # made before the restart stay valid); every other mount gets a new one
        keep = (signer is not None and prev is not None and prev.state == SegState.AWAITING
                and signer.has_key(desc.segment_id))
        self.dir.mount(client_id, desc)
        if signer is None:
            return {}
        if keep:
            key = signer.key_for(desc.segment_id)
        else:
            key = signer.rotate(desc.segment_id)
            self._save_keys()  # durable before the reply hands the key out
        return {"capability_key": key}

    def _op_unmount_segment(self, args: dict[str, Any]) -> dict[str, Any]:
        self.dir.unmount(_arg_str(args, "client_id"), _arg_str(args, "segment_id"))
        return {}

    def _op_get_segments(self, args: dict[str, Any]) -> dict[str, Any]:
        ids = args.get("segment_ids")
        if type(ids) is not list or len(ids) > self.max_batch:
            raise _bad("segment_ids must be a list")
        segs = self.dir.segments
        return {"segments": {i: segs[i].wire for i in ids
                             if type(i) is str and i in segs and segs[i].state == SegState.ACTIVE}}

    def _op_list_segments(self, args: dict[str, Any]) -> dict[str, Any]:
        out = []
        for seg in self.dir.segments.values():
            w = dict(seg.wire)
            w.update(used=seg.alloc.used, capacity=seg.alloc.capacity,
                     fragmentation=round(seg.alloc.fragmentation(), 4),
                     free_blocks=seg.alloc.free_blocks, objects=len(seg.keys),
                     state=seg.state.name.lower())
            out.append(w)
        return {"segments": out}

    def _op_local_endpoint(self, args: dict[str, Any]) -> dict[str, Any]:
        if self.local_rpc is None:
            return {}
        return {"path": self.local_rpc.path, "instance": self.local_rpc.instance}

    def _op_stats(self, args: dict[str, Any]) -> dict[str, Any]:
        s = self.dir.stats()
        s.update(self.tiering.stats())
        s.update(uptime_s=time.monotonic() - self.started, version=__version__,
                 snapshots=self.snapshot_count,
                 last_snapshot_pause_ms=self.last_snapshot_pause_ms,
                 last_snapshot_pause_cpu_ms=self.last_snapshot_pause_cpu_ms,
                 max_snapshot_step_ms=self.max_snapshot_step_ms,
                 max_snapshot_step_cpu_ms=self.max_snapshot_step_cpu_ms,
                 loadavg=os.getloadavg()[0],
                 curve=self._auth is not None,
                 capabilities=self.signer is not None,
                 capabilities_granted=self.signer.granted if self.signer is not None else 0,
                 too_many_requests=self.too_many_requests,
                 curve_denied=self._auth.denied if self._auth is not None else 0,
                 last_snapshot_duration_s=self.last_snapshot_duration_s,
                 snapshot_in_progress=self._snapshot is not None,
                 restored_objects=self.restored_objects,
                 max_loop_ms=self.max_loop_ms,
                 journal_seq=self.journal.seq if self.journal else None,
                 local_rpc_requests=self.local_rpc.requests if self.local_rpc else 0,
                 local_rpc_connections=self.local_rpc.connections if self.local_rpc else 0,
                 pid=os.getpid())
        return s

    # ---------------------------------------------------------------- put
    def _put_item(self, client_id: str, item: Any, segs: dict[str, Any]) -> list[Any]:
        if type(item) is not dict:
            return [int(ErrorCode.INVALID_PARAMS), "item must be a map"]
        key = self._key(item.get("key"))
        if key is None:
            return [int(ErrorCode.INVALID_KEY), None]
        size = item.get("size")
        if type(size) is not int or size <= 0 or size > self.cfg.max_object_size:
            return [int(ErrorCode.INVALID_PARAMS), "size must be an int in [1, max_object_size]"]
        if len(item) == 2:  # only key and size: defaults (the hot path skips the rest)
            code, p = self.dir.put_start(client_id, key, size)
            if code:
                return [int(code), None]
            return [0, self._replicas_wire(p, _PROCESSING, segs)]
        rn = item.get("replica_num", 1)
        dn = item.get("disk_replica_num", 0)
        maxr = self.cfg.max_replica_num
        if type(rn) is not int or type(dn) is not int or not (0 <= rn <= maxr) \
                or not (0 <= dn <= maxr) or rn + dn == 0:
            return [int(ErrorCode.INVALID_PARAMS), "bad replica_num/disk_replica_num"]
        pref = item.get("preferred_segments") or []
        if type(pref) is not list or len(pref) > 64 or any(type(p) is not str for p in pref):
            return [int(ErrorCode.INVALID_PARAMS), "preferred_segments must be a list of str"]
        hard = item.get("hard_pin", False)
        soft = item.get("soft_pin", False)
        if type(hard) is not bool or type(soft) is not bool:
            return [int(ErrorCode.INVALID_PARAMS), "pins must be bools"]
        checksum = item.get("checksum")
        if checksum is not None and type(checksum) not in (int, str, bytes):
            return [int(ErrorCode.INVALID_PARAMS), "checksum must be int, str or bytes"]
        flags = (HARD_PIN if hard else 0) | (SOFT_PIN if soft else 0)
        code, p = self.dir.put_start(client_id, key, size, rn, pref, flags, checksum, dn)
        if code:
            return [int(code), None]
        return [0, self._replicas_wire(p, _PROCESSING, segs)]

    def _replicas_wire(self, p: Pending | Any, status: int, segs: dict[str, Any],
                       reps: tuple[Any, ...] | None = None) -> list[list[Any]]:
        """Replica descriptors (wire form); with capabilities on, each carries a
        WRITE (PROCESSING: a put) or READ (COMPLETE: a get) token for exactly
        its ``[offset, offset + size)``."""
        if reps is None:
            reps = p.replicas
        size = p.size
        signer = self.signer
        if signer is not None:
            grant = signer.grant_fast  # ~0.7 us per token
            if status == _PROCESSING:
                op, exp = _CAP_WRITE, _time_ns() // 1_000_000 + self._write_ttl_ms
            else:
                op, exp = _CAP_READ, _time_ns() // 1_000_000 + signer.ttl_ms
        if len(reps) == 2:
            seg = reps[0]
            sid = seg.id
            if sid not in segs:
                segs[sid] = seg.wire
            off = reps[1]
            if signer is None:
                return [[sid, off, size, status, _EMPTY]]
            return [[sid, off, size, status, grant(sid, off, size, op, exp)]]
        out = []
        for i in range(0, len(reps), 2):
            seg = reps[i]
            sid = seg.id
            if sid not in segs:
                segs[sid] = seg.wire
            off = reps[i + 1]
            out.append([sid, off, size, status,
                        _EMPTY if signer is None else grant(sid, off, size, op, exp)])
        return out

    def _op_put_start(self, args: dict[str, Any]) -> dict[str, Any]:
        client_id = _arg_str(args, "client_id")
        segs: dict[str, Any] = {}
        code, val = self._put_item(client_id, args, segs)
        self.key_ops["put_start"] = self.key_ops.get("put_start", 0) + 1
        if code:
            raise KVPoolError(val if isinstance(val, str) else "put_start failed", code)
        return {"replicas": val, "segments": segs}

    def _op_batch_put_start(self, args: dict[str, Any]) -> dict[str, Any]:
        client_id = _arg_str(args, "client_id")
        items = args.get("items")
        if type(items) is not list:
            raise _bad("items must be a list")
        if len(items) > self.max_batch:
            raise _bad(f"batch of {len(items)} exceeds max_batch_size {self.max_batch}")
        segs: dict[str, Any] = {}
        put_item = self._put_item
        results = [put_item(client_id, it, segs) for it in items]
        self._count("put_start", len(items), results)
        return {"results": results, "segments": segs}

    def _op_put_end(self, args: dict[str, Any]) -> dict[str, Any]:
        code = self.dir.put_end(_arg_str(args, "client_id"), self._one_key(args))
        self.key_ops["put_end"] = self.key_ops.get("put_end", 0) + 1
        self._raise(code, "put_end")
        return {}

    def _op_put_revoke(self, args: dict[str, Any]) -> dict[str, Any]:
        code = self.dir.put_revoke(_arg_str(args, "client_id"), self._one_key(args))
        self._raise(code, "put_revoke")
        return {}

    def _batch_keyed(self, name: str, args: dict[str, Any],
                     fn: Callable[[str], int]) -> dict[str, Any]:
        keys = self._keys(args)
        valid = self._key
        bad = int(ErrorCode.INVALID_KEY)
        results: list[list[Any]] = [[int(fn(k)), None] if valid(k) is not None else [bad, None]
                                    for k in keys]
        self._count(name, len(keys), results)
        return {"results": results, "segments": {}}

    def _op_batch_put_end(self, args: dict[str, Any]) -> dict[str, Any]:
        client_id = _arg_str(args, "client_id")
        keys = self._keys(args)
        put_end = self.dir.put_end
        valid = self._key
        bad = int(ErrorCode.INVALID_KEY)
        results: list[list[Any]] = [
            [int(put_end(client_id, k)), None] if valid(k) is not None else [bad, None]
            for k in keys]
        self._count("put_end", len(keys), results)
        return {"results": results, "segments": {}}

    def _op_batch_put_revoke(self, args: dict[str, Any]) -> dict[str, Any]:
        client_id = _arg_str(args, "client_id")
        revoke = self.dir.put_revoke
        return self._batch_keyed("put_revoke", args, lambda k: revoke(client_id, k))

    # ---------------------------------------------------------------- reads
    def _get_one(self, key: str, segs: dict[str, Any]) -> tuple[int, Any]:
        code, val = self.dir.get_replicas(key)
        if code:
            return int(code), None
        obj, reps = val
        if reps[0].kind is _FILE:  # served from disk: maybe promote (SSD tier)
            self.tiering.on_disk_hit(self.dir, key, obj, reps)
        return 0, {"size": obj.size, "checksum": obj.checksum,
                   "lease_ttl_ms": self.cfg.lease_ttl_ms,
                   "replicas": self._replicas_wire(obj, _COMPLETE, segs, reps)}

    def _op_get_replica_list(self, args: dict[str, Any]) -> dict[str, Any]:
        segs: dict[str, Any] = {}
        code, val = self._get_one(self._one_key(args), segs)
        self.key_ops["get_replica_list"] = self.key_ops.get("get_replica_list", 0) + 1
        self._raise(code, "get_replica_list")
        val["segments"] = segs
        return dict(val)

    def _op_batch_get_replica_list(self, args: dict[str, Any]) -> dict[str, Any]:
        keys = self._keys(args)
        segs: dict[str, Any] = {}
        valid = self._key
        get_one = self._get_one
        bad = [int(ErrorCode.INVALID_KEY), None]
        results = [list(get_one(k, segs)) if valid(k) is not None else bad for k in keys]
        self._count("get_replica_list", len(keys), results)
        return {"results": results, "segments": segs}

    def _op_exist(self, args: dict[str, Any]) -> dict[str, Any]:
        self.key_ops["exist"] = self.key_ops.get("exist", 0) + 1
        return {"exists": self.dir.exist(self._one_key(args))}

    def _op_batch_exist(self, args: dict[str, Any]) -> dict[str, Any]:
        keys = self._keys(args)
        exist = self.dir.exist
        valid = self._key
        bad = [int(ErrorCode.INVALID_KEY), None]
        results = [[0, exist(k)] if valid(k) is not None else bad for k in keys]
        self._count("exist", len(keys), results)
        return {"results": results, "segments": {}}

    def _op_get_size(self, args: dict[str, Any]) -> dict[str, Any]:
        code, size = self.dir.get_size(self._one_key(args))
        self._raise(code, "get_size")
        return {"size": size}

    def _op_batch_get_size(self, args: dict[str, Any]) -> dict[str, Any]:
        keys = self._keys(args)
        get_size = self.dir.get_size
        valid = self._key
        bad = [int(ErrorCode.INVALID_KEY), None]
        results = []
        for k in keys:
            if valid(k) is None:
                results.append(bad)
            else:
                code, size = get_size(k)
                results.append([int(code), size])
        self._count("get_size", len(keys), results)
        return {"results": results, "segments": {}}

    # ---------------------------------------------------------------- remove
    def _op_remove(self, args: dict[str, Any]) -> dict[str, Any]:
        code = self.dir.remove(self._one_key(args), _arg_bool(args, "force"))
        self._raise(code, "remove")
        return {}

    def _op_batch_remove(self, args: dict[str, Any]) -> dict[str, Any]:
        force = _arg_bool(args, "force")
        remove = self.dir.remove
        return self._batch_keyed("remove", args, lambda k: remove(k, force))

    def _op_remove_all(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"removed": self.dir.remove_all(_arg_bool(args, "force"))}

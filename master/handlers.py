"""The master's op handlers: request Struct in, reply Struct out, no sockets.

:class:`OpHandlers` serves every op of :data:`kvpool.core.protocol.OPS`
against a :class:`~kvpool.master.directory.Directory`: one method per op,
named after it (``Op.BATCH_PUT_START`` -> ``batch_put_start``), taking the
decoded request and returning the reply or raising :class:`KVPoolError`.
:meth:`OpHandlers.handle_payload` is the whole request path (decode, run,
encode, count) as bytes in, bytes out: the event loop calls it for ZeroMQ
and Unix-socket frames alike, and tests call it without any socket.

The schema has already checked every type; what is left here are the
checks that depend on configuration (key length, sizes, batch length,
replica counts). Directory changes are appended to ``directory.records``;
the caller commits them (durability) before it sends the replies.

Capabilities: a reply that grants replicas carries one token per segment
(and per ``MAX_RANGES`` ranges) in ``caps``; each replica points at its
token (:class:`_Grants`). Signing is per batch and segment, not per key.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from kvpool.core import __version__
from kvpool.core.capability import MAX_RANGES, CapabilitySigner, CapOp
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    KEY_MIN,
    OPS,
    RESERVED_KEY_PREFIX,
    BatchExist,
    BatchExistReply,
    BatchGetReplicaList,
    BatchGetReplicaListReply,
    BatchGetSize,
    BatchGetSizeReply,
    BatchKeysReply,
    BatchPutCommit,
    BatchPutEnd,
    BatchPutRevoke,
    BatchPutStart,
    BatchPutStartReply,
    BatchRemove,
    BatchReplicaClear,
    BatchReserveReply,
    BatchUpsertStart,
    CreateCopyTask,
    CreateMoveTask,
    Empty,
    Exist,
    ExistReply,
    GetReplicaList,
    GetReplicaListReply,
    GetSegments,
    GetSegmentsReply,
    GetSize,
    GetSizeReply,
    ListObjects,
    ListObjectsReply,
    ListSegments,
    ListSegmentsReply,
    LocalEndpoint,
    LocalEndpointReply,
    MountSegment,
    MountSegmentReply,
    Ping,
    PingReply,
    PutCommit,
    PutEnd,
    PutOptions,
    PutRevoke,
    PutStart,
    PutStartReply,
    QueryTask,
    QueryTaskReply,
    Remove,
    RemoveAll,
    RemoveAllReply,
    RemoveByRegex,
    ReplicaDescriptor,
    ReplicaStatus,
    Reply,
    Request,
    ReserveReply,
    SegmentDescriptor,
    SegmentInfo,
    SegmentKind,
    Stats,
    StatsReply,
    TaskReply,
    TierTask,
    TierTaskDone,
    UnmountSegment,
    UpsertStart,
    decode_request,
    encode_error,
    encode_reply,
    peek_id,
)
from kvpool.master.config import MasterConfig
from kvpool.master.directory import HARD_PIN, SOFT_PIN, Directory, SegState, write_grant_ms
from kvpool.master.events import list_objects
from kvpool.master.stats import LoopStats, OpCounters
from kvpool.master.tiering import TieringPolicy

__all__ = ["OpHandlers", "ServerInfo"]

log = logging.getLogger(__name__)

_PROCESSING = ReplicaStatus.PROCESSING
_COMPLETE = ReplicaStatus.COMPLETE
_CAP_WRITE = int(CapOp.WRITE)
_CAP_READ = int(CapOp.READ)
_FILE = SegmentKind.FILE
_INVALID_KEY = int(ErrorCode.INVALID_KEY)
_INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
_NO_RESERVATION = ReserveReply()
_time_ns = time.time_ns  # capability expiry is wall-clock epoch ms (it crosses hosts)
_NO_REPLICAS: list[ReplicaDescriptor] = []  # shared by every failed key of a reply


def _never_open(_sid: str) -> None:
    return None
_STATS_FIELDS = frozenset(StatsReply.__struct_fields__)
_CODE_NAMES = {int(c): c.name for c in ErrorCode}


def _bad(msg: str, code: ErrorCode = ErrorCode.INVALID_PARAMS) -> KVPoolError:
    return KVPoolError(msg, code)


class ServerInfo:
    """What the handlers learn from the process around them (the event loop,
    durability, the admin endpoints). Defaults serve a socket-free test."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.loop = LoopStats()
        #: persist the capability keys before a MOUNT reply hands one out
        self.save_keys: Callable[[], None] = lambda: None
        #: (path, instance, tcp_port) of the direct RPC sockets, or None
        self.local_endpoint: Callable[[], tuple[str, str, int] | None] = lambda: None
        #: requests / connections served over the same-host socket
        self.local_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.curve = False
        self.curve_denied: Callable[[], int] = lambda: 0
        #: (stream, seq, epoch) of the event stream (kvpool.master.events); zeros when off
        self.events_position: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)


class _Grants:
    """The capability tokens of one reply: ranges collected per segment while
    replicas are built, one token signed per segment and MAX_RANGES ranges."""

    __slots__ = ("caps", "exp", "op", "open", "signer")

    def __init__(self, signer: CapabilitySigner | None, op: int, exp: int) -> None:
        self.signer = signer
        self.op = op
        self.exp = exp
        self.caps: list[bytes] = []
        # segment id -> (index in caps, flat ranges) of its token still filling
        self.open: dict[str, tuple[int, list[int]]] = {}

    def slot(self, sid: str, off: int, size: int) -> int:
        """Add ``[off, off + size)`` of ``sid``; the index of its token (-1: none)."""
        signer = self.signer
        if signer is None:
            return -1
        entry = self.open.get(sid)
        if entry is None or len(entry[1]) >= 2 * MAX_RANGES:
            if entry is not None:  # full: sign it now, open the next
                self.caps[entry[0]] = signer.grant_ranges(sid, entry[1], self.op, self.exp)
            entry = (len(self.caps), [])
            self.caps.append(b"")
            self.open[sid] = entry
        flat = entry[1]
        flat.append(off)
        flat.append(size)
        return entry[0]

    def sign(self) -> list[bytes]:
        """Sign the tokens still open; the reply's ``caps``."""
        signer = self.signer
        if signer is not None:
            caps = self.caps
            for sid, (i, flat) in self.open.items():
                caps[i] = signer.grant_ranges(sid, flat, self.op, self.exp)
            self.open.clear()
        return self.caps


class OpHandlers:
    """Every op of the table, socket-free (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, directory: Directory, tiering: TieringPolicy,
                 signer: CapabilitySigner | None, info: ServerInfo | None = None) -> None:
        self.cfg = cfg
        self.dir = directory
        self.tiering = tiering
        self.signer = signer
        self.info = info or ServerInfo()
        self.counters = OpCounters()
        self.max_key = cfg.max_key_length
        self.max_batch = cfg.max_batch_size
        self.max_frame = cfg.max_frame_size
        # a WRITE grant lasts as long as the put may (a big put over a slow link
        # must not be cut off mid-way); READ grants last a read lease
        ttl = cfg.capability_ttl_ms or cfg.lease_ttl_ms
        self._read_ttl_ms = signer.ttl_ms if signer is not None else ttl
        self._write_ttl_ms = write_grant_ms(cfg)  # the directory holds revoked space as long
        # a reservation's placeholder key: unique to this process (a restarted or
        # new leader never names another range the same) and to the reservation
        self._resv_prefix = f"{RESERVED_KEY_PREFIX}resv/{secrets.token_hex(8)}/"
        self._resv_seq = itertools.count()
        # how long a client may start its write into a reservation: within its
        # WRITE grant and well before the pending-put sweep revokes it
        life = min(self._write_ttl_ms, int(cfg.put_start_release_timeout_s * 1000))
        self._resv_ttl_ms = life - max(1000, life // 4)
        self._run: dict[int, tuple[str, Callable[[Any], Reply]]] = {}
        for op, spec in OPS.items():
            fn = getattr(self, spec.handler_name, None)
            if fn is None:
                raise TypeError(f"OpHandlers has no handler {spec.handler_name!r} for {op.name}")
            self._run[int(op)] = (op.name, fn)

    # ================================================================ dispatch
    def handle(self, req: Request[Any]) -> Reply:
        """Run one decoded request (counted); raises KVPoolError on an error."""
        name, fn = self._run[req.OP]
        ops = self.counters.ops
        ops[name] = ops.get(name, 0) + 1
        return fn(req)

    def handle_payload(self, payload: bytes) -> bytes:
        """Decode one request frame, run it, encode the reply. Never raises."""
        rid: int | None = None
        name = "invalid"
        try:
            rid, spec, req = decode_request(payload, self.max_frame)
            name, fn = self._run[spec.op]
            ops = self.counters.ops
            ops[name] = ops.get(name, 0) + 1
            return encode_reply(rid, fn(req))
        except KVPoolError as exc:
            code = exc.code
            text = str(exc)
            rid = getattr(exc, "request_id", rid)
            if code == ErrorCode.UNKNOWN_OP:
                name = "unknown"
        except Exception as exc:  # a bug: answer and keep serving
            log.exception("internal error handling %s", name)
            code = ErrorCode.INTERNAL_ERROR
            text = f"{type(exc).__name__}: {exc}"
        self.counters.error(name, code.name)
        return encode_error(rid, code, text[:1000])

    def too_many(self, payload: bytes) -> bytes:
        """The reply to a request beyond ``max_inflight_per_client`` (not run)."""
        c = self.counters
        c.too_many_requests += 1
        c.error("invalid", ErrorCode.TOO_MANY_REQUESTS.name)
        return encode_error(
            peek_id(payload), ErrorCode.TOO_MANY_REQUESTS,
            f"more than {self.cfg.max_inflight_per_client} requests queued on this "
            "connection; wait for replies before sending more")

    def _count(self, name: str, codes: list[int]) -> None:
        key_ops = self.counters.key_ops
        key_ops[name] = key_ops.get(name, 0) + len(codes)
        if any(codes):
            err = self.counters.error
            for c in codes:
                if c:
                    err(name, _CODE_NAMES.get(c, str(c)))

    def _count_one(self, name: str) -> None:
        key_ops = self.counters.key_ops
        key_ops[name] = key_ops.get(name, 0) + 1

    # ================================================================ checks
    def _key(self, key: str) -> str:
        if key < KEY_MIN or len(key) > self.max_key:
            raise _bad(f"key must be a non-empty string of at most {self.max_key} characters "
                       "not starting with NUL (reserved)",
                       ErrorCode.INVALID_KEY)
        return key

    def _batch(self, keys: list[Any]) -> None:
        if len(keys) > self.max_batch:
            raise _bad(f"batch of {len(keys)} exceeds max_batch_size {self.max_batch}")

    @staticmethod
    def _client(client_id: str) -> str:
        if not client_id:
            raise _bad("client_id must be a non-empty string")
        return client_id

    @staticmethod
    def _raise(code: int, what: str) -> None:
        if code:
            raise KVPoolError(what, code)

    def _options(self, o: PutOptions | None) -> tuple[int, int, list[str], int]:
        """(replica_num, disk_replica_num, preferred, flags) of validated options."""
        if o is None:
            return 1, 0, [], 0
        maxr = self.cfg.max_replica_num
        rn, dn = o.replica_num, o.disk_replica_num
        if not (0 <= rn <= maxr) or not (0 <= dn <= maxr) or rn + dn == 0:
            raise _bad("bad replica_num/disk_replica_num")
        if len(o.preferred_segments) > 64:
            raise _bad("at most 64 preferred_segments")
        ttl = o.soft_pin_ttl_ms
        if ttl < -1 or ttl > self.cfg.max_soft_pin_ttl_ms or (ttl != -1 and not o.soft_pin):
            raise _bad(f"soft_pin_ttl_ms must be -1 or in [0, {self.cfg.max_soft_pin_ttl_ms}], "
                       "and only with soft_pin")
        if o.soft_unpin and o.soft_pin:
            raise _bad("soft_pin and soft_unpin exclude each other")
        return rn, dn, o.preferred_segments, \
            (HARD_PIN if o.hard_pin else 0) | (SOFT_PIN if o.soft_pin else 0)

    @staticmethod
    def _pin_args(o: PutOptions | None) -> dict[str, Any]:
        """The directory's soft-pin arguments of (validated) options."""
        if o is None or (o.soft_pin_ttl_ms == -1 and not o.soft_unpin):
            return {}
        return {"soft_pin_ms": o.soft_pin_ttl_ms, "unpin": o.soft_unpin}

    # ================================================================ segments
    def ping(self, req: Ping) -> PingReply:
        client_id = self._client(req.client_id)
        d = self.dir
        if req.heartbeat:
            # from the client's guard process: its memory lives (it may be stalled)
            return PingReply(False, known=d.heartbeat(client_id))
        remount, ids = d.ping(client_id)
        out = PingReply(remount, ids)
        if self.signer is not None and self.signer.epoch:
            out.epoch = self.signer.epoch  # the term this master signs in (HA fencing)
        if self.tiering.tasks:  # SSD tier: copy tasks this node executes
            wires, _segs = self.tiering.tasks_for(d, client_id)
            if wires:
                grants = _Grants(self.signer, _CAP_WRITE, self._task_expiry())
                segs: dict[str, SegmentDescriptor] = {}
                tasks = []
                for w in wires:
                    (src_id, src_off), (dst_id, dst_off) = w["src"], w["dst"]
                    for sid in (src_id, dst_id):
                        seg = d.segments.get(sid)
                        if seg is not None:
                            segs[sid] = seg.desc
                    tasks.append(TierTask(w["id"], w["kind"], w["key"], w["size"], src_id,
                                          src_off, dst_id, dst_off, int(w.get("ttl_ms", 0)),
                                          grants.slot(dst_id, dst_off, w["size"])))
                out.tasks = tasks
                out.segments = segs
                out.caps = grants.sign()
        return out

    def _task_expiry(self) -> int:
        signer = self.signer
        if signer is None:
            return 0
        return signer.expiry(max(signer.ttl_ms, int(self.cfg.tiering.task_timeout_s * 1000)))

    def tier_task_done(self, req: TierTaskDone) -> Empty:
        self._raise(self.tiering.complete(self.dir, self._client(req.client_id), req.task_id,
                                          req.ok, req.error[:500]), "tier_task_done")
        return Empty()

    def mount_segment(self, req: MountSegment) -> MountSegmentReply:
        client_id = self._client(req.client_id)
        desc = req.segment
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
            return MountSegmentReply()
        if keep:
            key = signer.key_for(desc.segment_id)
        else:
            key = signer.rotate(desc.segment_id)
            self.info.save_keys()  # durable before the reply hands the key out
        return MountSegmentReply(key)

    def unmount_segment(self, req: UnmountSegment) -> Empty:
        if not req.segment_id:
            raise _bad("segment_id must be a non-empty string")
        self.dir.unmount(self._client(req.client_id), req.segment_id)
        return Empty()

    def get_segments(self, req: GetSegments) -> GetSegmentsReply:
        self._batch(req.segment_ids)
        segs = self.dir.segments
        active = SegState.ACTIVE
        out = {}
        for i in req.segment_ids:
            seg = segs.get(i)
            if seg is not None and seg.state == active:
                out[i] = seg.desc
        return GetSegmentsReply(out)

    def list_segments(self, req: ListSegments | None = None) -> ListSegmentsReply:
        return ListSegmentsReply([
            SegmentInfo(seg.desc, seg.alloc.used, seg.alloc.capacity,
                        round(seg.alloc.fragmentation(), 4), seg.alloc.free_blocks,
                        len(seg.keys), seg.state.name.lower())
            for seg in list(self.dir.segments.values())])

    def local_endpoint(self, req: LocalEndpoint) -> LocalEndpointReply:
        ep = self.info.local_endpoint()
        return LocalEndpointReply() if ep is None else LocalEndpointReply(*ep)

    def stats(self, req: Stats | None = None) -> StatsReply:
        d = dict(self.dir.stats())
        extra = {k: d.pop(k) for k in list(d) if k not in _STATS_FIELDS}
        info = self.info
        loop = info.loop
        local_requests, local_conns = info.local_counts()
        signer = self.signer
        return StatsReply(
            **d, uptime_s=time.monotonic() - info.started, version=__version__,
            pid=os.getpid(), loadavg=os.getloadavg()[0], curve=info.curve,
            curve_denied=info.curve_denied(), capabilities=signer is not None,
            capabilities_granted=signer.granted if signer is not None else 0,
            too_many_requests=self.counters.too_many_requests,
            snapshots=loop.snapshots, snapshot_in_progress=loop.snapshot_in_progress,
            last_snapshot_pause_ms=loop.last_snapshot_pause_ms,
            last_snapshot_pause_cpu_ms=loop.last_snapshot_pause_cpu_ms,
            max_snapshot_step_ms=loop.max_snapshot_step_ms,
            max_snapshot_step_cpu_ms=loop.max_snapshot_step_cpu_ms,
            last_snapshot_duration_s=loop.last_snapshot_duration_s,
            restored_objects=loop.restored_objects, max_loop_ms=loop.max_loop_ms,
            journal_seq=loop.journal_seq, local_rpc_requests=local_requests,
            local_rpc_connections=local_conns, tiering=dict(self.tiering.stats()),
            extra=extra)

    # ================================================================ put
    def _grants(self, op: int) -> _Grants:
        ttl = self._write_ttl_ms if op == _CAP_WRITE else self._read_ttl_ms
        return _Grants(self.signer, op, _time_ns() // 1_000_000 + ttl)

    @staticmethod
    def _replicas(reps: tuple[Any, ...], size: int, status: ReplicaStatus,
                  segs: dict[str, SegmentDescriptor], grants: _Grants) -> list[ReplicaDescriptor]:
        """Descriptors of the flat ``(segment, offset, ...)`` replicas, each
        pointing at the token that covers it."""
        slot = grants.slot
        out = []
        for i in range(0, len(reps), 2):
            seg = reps[i]
            sid = seg.id
            if sid not in segs:
                segs[sid] = seg.desc
            off = reps[i + 1]
            out.append(ReplicaDescriptor(sid, off, size, status, slot(sid, off, size)))
        return out

    def _described(self, placed: list[Any], sizes: list[int], status: ReplicaStatus,
                   segs: dict[str, SegmentDescriptor], grants: _Grants, one: bool = False
                   ) -> list[Any]:
        """:meth:`_replicas` of each key's flat replicas ``placed[i]`` of
        ``sizes[i]`` bytes (None: no replicas), a single replica (the common
        case) inline: the token still filling for its segment is used as
        :meth:`_Grants.slot` would. ``one`` (every key placed has one replica):
        the placed keys' descriptors, in order, not a list per key."""
        slot = grants.slot
        open_get = grants.open.get if grants.signer is not None else _never_open
        full = 2 * MAX_RANGES
        n = len(placed)
        out: list[Any] = [] if one else [_NO_REPLICAS] * n
        one_append = out.append
        for i in range(n):
            reps = placed[i]
            if reps is None:
                continue
            size = sizes[i]
            if len(reps) == 2:
                seg = reps[0]
                sid = seg.id
                off = reps[1]
                entry = open_get(sid)
                if entry is None or len(entry[1]) >= full:
                    cap = slot(sid, off, size)
                    segs[sid] = seg.desc
                else:
                    cap = entry[0]
                    entry[1].extend((off, size))
                if one:
                    one_append(ReplicaDescriptor(sid, off, size, status, cap))
                else:
                    out[i] = [ReplicaDescriptor(sid, off, size, status, cap)]
            else:
                out[i] = self._replicas(reps, size, status, segs, grants)
        return out

    def _granted(self, reps: tuple[Any, ...], size: int, status: ReplicaStatus, op: int
                 ) -> tuple[list[ReplicaDescriptor], dict[str, SegmentDescriptor], list[bytes]]:
        """(replicas, segments, caps) of one key's reply: what :meth:`_replicas`
        and :meth:`_Grants.sign` give, with one replica (the common case) signed
        directly."""
        segs: dict[str, SegmentDescriptor] = {}
        if len(reps) != 2:
            grants = self._grants(op)
            return self._replicas(reps, size, status, segs, grants), segs, grants.sign()
        seg = reps[0]
        sid = seg.id
        off = reps[1]
        segs[sid] = seg.desc
        signer = self.signer
        if signer is None:
            return [ReplicaDescriptor(sid, off, size, status, -1)], segs, []
        ttl = self._write_ttl_ms if op == _CAP_WRITE else self._read_ttl_ms
        cap = signer.grant_ranges(sid, (off, size), op, _time_ns() // 1_000_000 + ttl)
        return [ReplicaDescriptor(sid, off, size, status, 0)], segs, [cap]

    def put_start(self, req: PutStart, replace: bool = False) -> PutStartReply:
        client_id = self._client(req.client_id)
        key = self._key(req.key)
        size = req.size
        if size <= 0 or size > self.cfg.max_object_size:
            raise _bad("size must be an int in [1, max_object_size]")
        rn, dn, pref, flags = self._options(req.options)
        if req.group is not None and len(req.group) > self.max_key:
            raise _bad(f"group longer than max_key_length {self.max_key}")
        self._count_one("upsert_start" if replace else "put_start")
        code, p = self.dir.put_start(client_id, key, size, rn, pref, flags, req.checksum, dn,
                                     replace=replace, group=req.group,
                                     **self._pin_args(req.options))
        self._raise(code, "put_start failed")
        return PutStartReply(*self._granted(p.replicas, size, _PROCESSING, _CAP_WRITE))

    def upsert_start(self, req: UpsertStart) -> PutStartReply:
        return self.put_start(req, replace=True)

    def batch_upsert_start(self, req: BatchUpsertStart) -> BatchPutStartReply:
        return self.batch_put_start(req, replace=True)

    def batch_put_start(self, req: BatchPutStart, replace: bool = False) -> BatchPutStartReply:
        client_id = self._client(req.client_id)
        keys, sizes, checksums, groups = req.keys, req.sizes, req.checksums, req.groups
        n = len(keys)
        self._batch(keys)
        if len(sizes) != n or (checksums is not None and len(checksums) != n) \
                or (groups is not None and len(groups) != n):
            raise _bad("keys, sizes, checksums and groups must have the same length")
        if groups is not None and any(len(g) > self.max_key for g in groups):
            raise _bad(f"a group is longer than max_key_length {self.max_key}")
        rn, dn, pref, flags = self._options(req.options)
        pin = self._pin_args(req.options)
        if replace:
            pin["replace"] = True
        simple = rn == 1 and dn == 0 and not pref and not flags and checksums is None \
            and not pin and groups is None
        put_start = self.dir.put_start
        max_key, max_size = self.max_key, self.cfg.max_object_size
        segs: dict[str, SegmentDescriptor] = {}
        grants = self._grants(_CAP_WRITE)
        codes = [0] * n
        placed: list[Any] = [None] * n  # the flat replicas of each key put
        if simple:
            self.dir.put_start_many(client_id, keys, sizes, max_key, max_size, codes, placed)
        else:
            for i in range(n):
                key = keys[i]
                size = sizes[i]
                if key < KEY_MIN or len(key) > max_key:
                    codes[i] = _INVALID_KEY
                    continue
                if size <= 0 or size > max_size:
                    codes[i] = _INVALID_PARAMS
                    continue
                code, p = put_start(client_id, key, size, rn, pref, flags,
                                    None if checksums is None else checksums[i], dn,
                                    group=None if groups is None else groups[i], **pin)
                if code:
                    codes[i] = int(code)
                    continue
                placed[i] = p.replicas
        out = self._described(placed, sizes, _PROCESSING, segs, grants)
        self._count("upsert_start" if replace else "put_start", codes)
        return BatchPutStartReply(codes, out, segs, grants.sign())

    def _reserve(self, client_id: str, size: int) -> ReserveReply:
        """A reservation of ``size`` bytes for ``client_id``'s next put: an
        ordinary pending put (one memory replica) under a fresh placeholder key,
        so its expiry, release with its client and fencing are a put's. An empty
        reply when none can be made (the commit before it is OK regardless)."""
        if size <= 0 or size > self.cfg.max_object_size or self._resv_ttl_ms <= 0:
            return ReserveReply()
        placeholder = f"{self._resv_prefix}{next(self._resv_seq)}"
        code, p = self.dir.put_start(client_id, placeholder, size)
        if code:
            return ReserveReply()
        self._count_one("reserve")
        return ReserveReply(placeholder,
                            *self._granted(p.replicas, size, _PROCESSING, _CAP_WRITE),
                            self._resv_ttl_ms)

    def _reserve_many(self, client_id: str, size: int, count: int,
                      codes: list[int]) -> BatchReserveReply:
        """A batch commit's reply (``codes``) with up to ``count``
        reservations of ``size`` bytes, as :meth:`_reserve` makes one, placed
        in one pass; no more than the commit had keys (a client holds at most
        a batch's worth), fewer (or none) when the pool cannot place them."""
        count = min(count, len(codes))
        if size <= 0 or size > self.cfg.max_object_size or self._resv_ttl_ms <= 0 \
                or count <= 0:
            return BatchReserveReply(codes)
        prefix = self._resv_prefix
        seq = self._resv_seq
        keys = [f"{prefix}{next(seq)}" for _ in range(count)]
        got = [0] * count
        sizes = [size] * count
        placed: list[Any] = [None] * count
        self.dir.put_start_many(client_id, keys, sizes, len(prefix) + 32,
                                self.cfg.max_object_size, got, placed, RESERVED_KEY_PREFIX)
        names: list[str] = []
        for i in range(count):
            reps = placed[i]
            if reps is None:
                continue
            if len(reps) != 2:  # more than one replica: not a reservation's shape
                self.dir.put_revoke(client_id, keys[i])
                placed[i] = None
                continue
            names.append(keys[i])
        if not names:
            return BatchReserveReply(codes)
        grants = self._grants(_CAP_WRITE)
        segs: dict[str, SegmentDescriptor] = {}
        out = self._described(placed, sizes, _PROCESSING, segs, grants, one=True)
        self._count("reserve", [0] * len(names))
        return BatchReserveReply(codes, names, out, segs, grants.sign(), self._resv_ttl_ms)

    def put_end(self, req: PutEnd) -> ReserveReply:
        client_id = self._client(req.client_id)
        code = self.dir.put_end(client_id, self._key(req.key))
        self._count_one("put_end")
        self._raise(code, "put_end")
        return self._reserve(client_id, req.reserve) if req.reserve else _NO_RESERVATION

    def put_commit(self, req: PutCommit) -> ReserveReply:
        client_id = self._client(req.client_id)
        placeholder = req.placeholder
        if not placeholder.startswith(self._resv_prefix):  # not this master's: lost
            raise KVPoolError("no such reservation", ErrorCode.OBJECT_NOT_FOUND)
        code = self.dir.put_commit(client_id, placeholder, self._key(req.key))
        self._count_one("put_end")
        self._raise(code, "put_commit")
        return self._reserve(client_id, req.reserve) if req.reserve else _NO_RESERVATION

    def put_revoke(self, req: PutRevoke) -> Empty:
        key = req.key  # the caller's own pending put: a placeholder too
        if not key.startswith(RESERVED_KEY_PREFIX):
            self._key(key)
        self._raise(self.dir.put_revoke(self._client(req.client_id), key), "put_revoke")
        return Empty()

    def _keyed(self, name: str, keys: list[str], fn: Callable[[str], int]) -> BatchKeysReply:
        self._batch(keys)
        max_key = self.max_key
        codes = [int(fn(k)) if k >= KEY_MIN and len(k) <= max_key else _INVALID_KEY for k in keys]
        self._count(name, codes)
        return BatchKeysReply(codes)

    def batch_put_end(self, req: BatchPutEnd) -> BatchReserveReply:
        client_id = self._client(req.client_id)
        keys = req.keys
        self._batch(keys)
        codes = self.dir.put_end_many(client_id, keys, self.max_key)
        self._count("put_end", codes)
        if req.reserve:
            return self._reserve_many(client_id, req.reserve, req.reserve_count, codes)
        return BatchReserveReply(codes)

    def batch_put_commit(self, req: BatchPutCommit) -> BatchReserveReply:
        client_id = self._client(req.client_id)
        keys, placeholders = req.keys, req.placeholders
        self._batch(keys)
        if len(placeholders) != len(keys):
            raise _bad("placeholders and keys must have the same length")
        prefix = self._resv_prefix
        if all(p.startswith(prefix) for p in placeholders):
            codes = self.dir.put_commit_many(client_id, placeholders, keys, self.max_key)
        else:  # another master's (a failover or restart lost them): those are not found
            ours = [i for i, p in enumerate(placeholders) if p.startswith(prefix)]
            codes = [int(ErrorCode.OBJECT_NOT_FOUND)] * len(keys)
            got = self.dir.put_commit_many(client_id, [placeholders[i] for i in ours],
                                           [keys[i] for i in ours], self.max_key)
            for i, code in zip(ours, got, strict=True):
                codes[i] = code
        self._count("put_end", codes)
        if req.reserve:
            return self._reserve_many(client_id, req.reserve, req.reserve_count, codes)
        return BatchReserveReply(codes)

    def batch_put_revoke(self, req: BatchPutRevoke) -> BatchKeysReply:
        client_id = self._client(req.client_id)
        revoke = self.dir.put_revoke
        keys = req.keys
        self._batch(keys)
        max_key = self.max_key
        # the caller's own pending puts: placeholders (reserved keys) too
        codes = [int(revoke(client_id, k)) if k and len(k) <= max_key else _INVALID_KEY
                 for k in keys]
        self._count("put_revoke", codes)
        return BatchKeysReply(codes)

    # ================================================================ reads
    def get_replica_list(self, req: GetReplicaList) -> GetReplicaListReply:
        key = self._key(req.key)
        self._count_one("get_replica_list")
        code, val = self.dir.get_replicas(key)
        self._raise(code, "get_replica_list")
        obj, reps = val
        if reps[0].kind is _FILE:  # served from disk: maybe promote (SSD tier)
            self.tiering.on_disk_hit(self.dir, key, obj, reps)
        replicas, segs, caps = self._granted(reps, obj.size, _COMPLETE, _CAP_READ)
        return GetReplicaListReply(obj.size, self.cfg.lease_ttl_ms, replicas, obj.checksum,
                                   segs, caps)

    def batch_get_replica_list(self, req: BatchGetReplicaList) -> BatchGetReplicaListReply:
        keys = req.keys
        self._batch(keys)
        n = len(keys)
        d = self.dir
        many = d.get_replicas_many
        on_disk_hit = self.tiering.on_disk_hit
        max_key = self.max_key
        segs: dict[str, SegmentDescriptor] = {}
        grants = self._grants(_CAP_READ)
        codes = [0] * n
        sizes = [0] * n
        objs: list[Any] = [None] * n
        found: list[Any] = [None] * n  # the active flat replicas of each key served
        # one directory pass; it pauses after a disk hit for the tiering hook
        i = many(keys, 0, max_key, codes, objs, found)
        while i < n:
            on_disk_hit(d, keys[i], objs[i], found[i])
            i = many(keys, i + 1, max_key, codes, objs, found)
        checksums: list[Any] | None = None
        for i in range(n):
            if found[i] is None:
                continue
            obj = objs[i]
            sizes[i] = obj.size
            if obj.checksum is not None:
                if checksums is None:
                    checksums = [None] * n
                checksums[i] = obj.checksum
        out = self._described(found, sizes, _COMPLETE, segs, grants)
        self._count("get_replica_list", codes)
        return BatchGetReplicaListReply(codes, sizes, out, self.cfg.lease_ttl_ms,
                                        checksums or [], segs, grants.sign())

    def exist(self, req: Exist) -> ExistReply:
        self._count_one("exist")
        return ExistReply(self.dir.exist(self._key(req.key)))

    def batch_exist(self, req: BatchExist) -> BatchExistReply:
        keys = req.keys
        self._batch(keys)
        codes, found = self.dir.exist_many(keys, self.max_key)
        self._count("exist", codes)
        return BatchExistReply(codes, found)

    def get_size(self, req: GetSize) -> GetSizeReply:
        code, size = self.dir.get_size(self._key(req.key))
        self._raise(code, "get_size")
        return GetSizeReply(size)

    def batch_get_size(self, req: BatchGetSize) -> BatchGetSizeReply:
        keys = req.keys
        self._batch(keys)
        get_size = self.dir.get_size
        max_key = self.max_key
        codes: list[int] = []
        sizes: list[int] = []
        for k in keys:
            if k < KEY_MIN or len(k) > max_key:
                codes.append(_INVALID_KEY)
                sizes.append(0)
                continue
            code, size = get_size(k)
            codes.append(int(code))
            sizes.append(size or 0)
        self._count("get_size", codes)
        return BatchGetSizeReply(codes, sizes)

    # ================================================================ remove
    def remove(self, req: Remove) -> Empty:
        self._raise(self.dir.remove(self._key(req.key), req.force), "remove")
        return Empty()

    def batch_remove(self, req: BatchRemove) -> BatchKeysReply:
        force = req.force
        remove = self.dir.remove
        return self._keyed("remove", req.keys, lambda k: remove(k, force))

    def batch_replica_clear(self, req: BatchReplicaClear) -> BatchKeysReply:
        client_id = self._client(req.client_id)
        clear = self.dir.replica_clear
        sid = req.segment_id
        return self._keyed("replica_clear", req.keys, lambda k: clear(client_id, k, sid))

    def remove_all(self, req: RemoveAll) -> RemoveAllReply:
        return RemoveAllReply(self.dir.remove_all(req.force))

    def remove_by_regex(self, req: RemoveByRegex) -> RemoveAllReply:
        if len(req.pattern) > self.max_key:
            raise _bad(f"pattern longer than max_key_length {self.max_key}")
        try:
            search = re.compile(req.pattern).search
        except re.error as exc:
            raise _bad(f"bad pattern {req.pattern!r}: {exc}") from None
        removed = self.dir.remove_matching(lambda k: search(k) is not None, req.force,
                                           req.prefix, req.exclude_prefix)
        self._count("remove", [0] * removed)
        return RemoveAllReply(removed)

    # ================================================================ replica tasks
    def _task(self, key: str, targets: list[str], source: str = "") -> TaskReply:
        self._key(key)
        if len(targets) > 64:
            raise _bad("at most 64 targets")
        code, job = self.tiering.create_job(self.dir, key, targets, source)
        self._count_one("create_task")
        self._raise(code, "create task failed")
        assert job is not None
        return TaskReply(job.id)

    def create_copy_task(self, req: CreateCopyTask) -> TaskReply:
        return self._task(req.key, req.targets)

    def create_move_task(self, req: CreateMoveTask) -> TaskReply:
        if not req.source:
            raise _bad("source must be a segment id")
        return self._task(req.key, [req.target], req.source)

    def query_task(self, req: QueryTask) -> QueryTaskReply:
        job = self.tiering.jobs.get(req.task_id)
        if job is None:
            raise _bad(f"no task {req.task_id}", ErrorCode.TASK_NOT_FOUND)
        return QueryTaskReply(job.id, job.move, job.key, int(job.status), job.created_ms,
                              job.updated_ms, job.executor, job.message)

    # ================================================================ events
    def list_objects(self, req: ListObjects) -> ListObjectsReply:
        self._count_one("list_objects")
        return list_objects(self.dir, req, self.info.events_position())

"""The handlers of the write ops: PUT_START / UPSERT_START, PUT_END,
PUT_COMMIT, PUT_REVOKE and their batch forms, and the reservations a commit
may answer with.

Each op is its batch form's core run on one key (:class:`Writes`' batch
methods); a single-key reply signs its one replica directly. A reservation
(PUT_END or PUT_COMMIT with ``reserve`` > 0) is an ordinary put in flight
of one memory replica under a placeholder key the master makes
(``\\x00resv/<per-process nonce>/<n>``, so a restarted or new leader never
names another range the same); PUT_COMMIT later names it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence
from typing import Any

from kvpool.core.capability import CapabilitySigner, CapOp
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    KEY_MIN,
    RESERVED_KEY_PREFIX,
    BatchKeysReply,
    BatchPutCommit,
    BatchPutEnd,
    BatchPutRevoke,
    BatchPutStart,
    BatchPutStartReply,
    BatchReserveReply,
    BatchUpsertStart,
    Empty,
    PutCommit,
    PutEnd,
    PutOptions,
    PutRevoke,
    PutStart,
    PutStartReply,
    ReplicaStatus,
    ReserveReply,
    SegmentDescriptor,
    UpsertStart,
)
from kvpool.master.config import MasterConfig
from kvpool.master.directory import HARD_PIN, SOFT_PIN, Directory
from kvpool.master.grants import describe
from kvpool.master.keys import INVALID_KEY, check_key
from kvpool.master.op_group import OpGroup, ServerInfo, bad
from kvpool.master.stats import OpCounters
from kvpool.master.tiering import TieringPolicy
from kvpool.master.writes import DEFAULT_PUT, PutSpec

__all__ = ["WriteOps"]

_PROCESSING = ReplicaStatus.PROCESSING
_CAP_WRITE = int(CapOp.WRITE)
_NO_ROOM = int(ErrorCode.NO_AVAILABLE_HANDLE)
_NO_RESERVATION = ReserveReply()
_UPSERT = PutSpec(replace=True)


class WriteOps(OpGroup):
    """Puts: start, commit (with reservations), revoke."""

    def __init__(self, cfg: MasterConfig, directory: Directory, tiering: TieringPolicy,
                 signer: CapabilitySigner | None, info: ServerInfo,
                 counters: OpCounters) -> None:
        super().__init__(cfg, directory, tiering, signer, info, counters)
        # a reservation's placeholder key: unique to this process (a restarted or
        # new leader never names another range the same) and to the reservation
        self._resv_prefix = f"{RESERVED_KEY_PREFIX}resv/{secrets.token_hex(8)}/"
        self._resv_seq = itertools.count()
        self._resv_max_key = len(self._resv_prefix) + 32
        # how long a client may start its write into a reservation: within its
        # WRITE grant and well before the pending-put sweep revokes it
        life = min(self.granter.write_ttl_ms, int(cfg.put_start_release_timeout_s * 1000))
        self._resv_ttl_ms = life - max(1000, life // 4)

    def _spec(self, o: PutOptions | None, replace: bool) -> PutSpec:
        """The put options of (validated) ``o``."""
        if o is None:
            return _UPSERT if replace else DEFAULT_PUT
        maxr = self.cfg.max_replica_num
        rn, dn = o.replica_num, o.disk_replica_num
        if not (0 <= rn <= maxr) or not (0 <= dn <= maxr) or rn + dn == 0:
            raise bad("bad replica_num/disk_replica_num")
        if len(o.preferred_segments) > 64:
            raise bad("at most 64 preferred_segments")
        ttl = o.soft_pin_ttl_ms
        if ttl < -1 or ttl > self.cfg.max_soft_pin_ttl_ms or (ttl != -1 and not o.soft_pin):
            raise bad(f"soft_pin_ttl_ms must be -1 or in [0, {self.cfg.max_soft_pin_ttl_ms}], "
                      "and only with soft_pin")
        if o.soft_unpin and o.soft_pin:
            raise bad("soft_pin and soft_unpin exclude each other")
        flags = (HARD_PIN if o.hard_pin else 0) | (SOFT_PIN if o.soft_pin else 0)
        return PutSpec(rn, dn, o.preferred_segments, flags, ttl, replace, o.soft_unpin)

    # ================================================================ start
    def put_start(self, req: PutStart, replace: bool = False) -> PutStartReply:
        client_id = self.check_client(req.client_id)
        s = self.scope(req.tenant)
        key = req.key
        if key < KEY_MIN or len(key) > self.max_key:
            check_key(key, self.max_key)  # (raises its error)
        size = req.size
        if size <= 0 or size > self.cfg.max_object_size:
            raise bad("size must be an int in [1, max_object_size]")
        o = req.options
        spec = (_UPSERT if replace else DEFAULT_PUT) if o is None else self._spec(o, replace)
        group = req.group
        if group is not None:
            if len(group) > self.max_key or (group and group < KEY_MIN):
                raise bad(f"group longer than max_key_length {self.max_key} or starting "
                          "below U+0020")
            if group and not s.default:  # a group lives in its tenant's namespace too
                group = s.prefix + group
        self.count_one("upsert_start" if replace else "put_start")
        codes = [0]
        placed: list[Any] = [None]
        self.dir.writes.put_start_many(client_id, (key if s.default else s.prefix + key,),
                                       (size,), codes, placed, spec,
                                       None if req.checksum is None else (req.checksum,),
                                       None if group is None else (group,), s.key_min,
                                       s.max_key)
        if codes[0]:
            self.fail(codes[0], "put_start failed" + (self.dir.writes.held_note()
                                                      if codes[0] == _NO_ROOM else ""), key)
        return PutStartReply(*self.granter.granted(placed[0], size, _PROCESSING, _CAP_WRITE))

    def upsert_start(self, req: UpsertStart) -> PutStartReply:
        return self.put_start(req, replace=True)

    def batch_upsert_start(self, req: BatchUpsertStart) -> BatchPutStartReply:
        return self.batch_put_start(req, replace=True)

    def batch_put_start(self, req: BatchPutStart, replace: bool = False) -> BatchPutStartReply:
        client_id = self.check_client(req.client_id)
        keys: Sequence[str] = req.keys
        sizes, checksums, groups = req.sizes, req.checksums, req.groups
        n = len(keys)
        self.check_batch(keys)
        if len(sizes) != n or (checksums is not None and len(checksums) != n) \
                or (groups is not None and len(groups) != n):
            raise bad("keys, sizes, checksums and groups must have the same length")
        if groups is not None and any(len(g) > self.max_key or (g and g < KEY_MIN)
                                      for g in groups):
            # (a group below U+0020 would name another tenant's)
            raise bad(f"a group is longer than max_key_length {self.max_key} or starts "
                      "below U+0020")
        spec = self._spec(req.options, replace)
        s = self.scope(req.tenant)
        if not s.default:
            keys = s.keys(keys)
            if groups is not None:
                groups = [s.prefix + g if g else g for g in groups]
        codes = [0] * n
        placed: list[Any] = [None] * n  # the flat replicas of each key put
        self.dir.writes.put_start_many(client_id, keys, sizes, codes, placed, spec, checksums,
                                       groups, s.key_min, s.max_key)
        segs: dict[str, SegmentDescriptor] = {}
        grants = self.granter.grants(_CAP_WRITE)
        out = describe(placed, sizes, _PROCESSING, segs, grants)
        self.count("upsert_start" if replace else "put_start", codes)
        return BatchPutStartReply(codes, out, segs, grants.sign())

    # ================================================================ reservations
    def _reservations(self, client_id: str, size: int, count: int) -> tuple[list[str],
                                                                            list[Any]]:
        """Up to ``count`` reservations of ``size`` bytes for ``client_id``'s
        next puts, placed in one pass: (placeholders, flat replicas). Fewer
        (or none) when the pool cannot place them in free memory below its
        high watermark (a reservation never evicts, spills or takes quota:
        ``put_start_many(room_only=True)``)."""
        if size <= 0 or size > self.cfg.max_object_size or self._resv_ttl_ms <= 0 \
                or count <= 0:
            return [], []
        prefix = self._resv_prefix
        seq = self._resv_seq
        if count == 1:  # a single commit's: no comprehensions to build
            keys = [f"{prefix}{next(seq)}"]
            codes = [0]
            placed: list[Any] = [None]
            sizes: tuple[int, ...] = (size,)
        else:
            keys = [f"{prefix}{next(seq)}" for _ in range(count)]
            codes = [0] * count
            placed = [None] * count
            sizes = (size,) * count
        writes = self.dir.writes
        writes.put_start_many(client_id, keys, sizes, codes, placed, DEFAULT_PUT, None, None,
                              RESERVED_KEY_PREFIX, self._resv_max_key, room_only=True)
        names, reps = keys, placed
        for r in placed:
            if r is None or len(r) != 2:  # not every one placed with one replica
                names, reps = self._kept(client_id, keys, placed)
                break
        if names:
            self.count_one("reserve", len(names))
        return names, reps

    def _kept(self, client_id: str, keys: list[str], placed: list[Any]
              ) -> tuple[list[str], list[Any]]:
        """The reservations of :meth:`_reservations` that were placed with one
        replica; one with more is revoked (not a reservation's shape)."""
        names: list[str] = []
        reps: list[Any] = []
        for key, r in zip(keys, placed, strict=True):
            if r is None:
                continue
            if len(r) != 2:
                self.dir.writes.revoke_many(client_id, (key,))
                continue
            names.append(key)
            reps.append(r)
        return names, reps

    def _reserve(self, client_id: str, size: int) -> ReserveReply:
        """A single commit's reply with a reservation of ``size`` bytes (an
        empty one when none can be made: the commit before it is OK
        regardless)."""
        names, reps = self._reservations(client_id, size, 1)
        if not names:
            return _NO_RESERVATION
        return ReserveReply(names[0], *self.granter.granted(reps[0], size, _PROCESSING,
                                                            _CAP_WRITE), self._resv_ttl_ms)

    def _reserve_many(self, client_id: str, size: int, count: int,
                      codes: list[int]) -> BatchReserveReply:
        """A batch commit's reply (``codes``) with up to ``count``
        reservations of ``size`` bytes; no more than the commit had keys (a
        client holds at most a batch's worth)."""
        names, reps = self._reservations(client_id, size, min(count, len(codes)))
        if not names:
            return BatchReserveReply(codes)
        grants = self.granter.grants(_CAP_WRITE)
        segs: dict[str, SegmentDescriptor] = {}
        out = describe(reps, [size] * len(reps), _PROCESSING, segs, grants, one=True)
        return BatchReserveReply(codes, names, out, segs, grants.sign(), self._resv_ttl_ms)

    # ================================================================ commit
    def put_end(self, req: PutEnd) -> ReserveReply:
        return self._commit(self.check_client(req.client_id), req.key, None, req.reserve,
                            req.tenant)

    def put_commit(self, req: PutCommit) -> ReserveReply:
        client_id = self.check_client(req.client_id)
        if not req.placeholder.startswith(self._resv_prefix):  # not this master's: lost
            raise KVPoolError("no such reservation", ErrorCode.OBJECT_NOT_FOUND)
        return self._commit(client_id, req.key, req.placeholder, req.reserve, req.tenant)

    def _commit(self, client_id: str, key: str, placeholder: str | None,
                reserve: int, tenant: str) -> ReserveReply:
        """PUT_END (``placeholder`` None) or PUT_COMMIT of one key of
        ``tenant`` by (checked) ``client_id``: the commit, and a reservation
        of ``reserve`` bytes after it (a placeholder is the client's own, in
        no tenant's namespace)."""
        s = self.scope(tenant)
        code = self.dir.writes.commit_many(
            client_id, (key if s.default else s.prefix + key,),
            None if placeholder is None else (placeholder,), s.key_min, s.max_key)[0]
        if code:
            if code != INVALID_KEY:
                self.count_one("put_end")
            self.fail(code, "put_end" if placeholder is None else "put_commit", key)
        self.count_one("put_end")
        return self._reserve(client_id, reserve) if reserve else _NO_RESERVATION

    def batch_put_end(self, req: BatchPutEnd) -> BatchReserveReply:
        client_id = self.check_client(req.client_id)
        keys = req.keys
        self.check_batch(keys)
        s = self.scope(req.tenant)
        codes = self.dir.writes.commit_many(client_id, s.keys(keys), None, s.key_min, s.max_key)
        self.count("put_end", codes)
        if req.reserve:
            return self._reserve_many(client_id, req.reserve, req.reserve_count, codes)
        return BatchReserveReply(codes)

    def batch_put_commit(self, req: BatchPutCommit) -> BatchReserveReply:
        client_id = self.check_client(req.client_id)
        keys: Sequence[str] = req.keys
        placeholders = req.placeholders
        self.check_batch(keys)
        if len(placeholders) != len(keys):
            raise bad("placeholders and keys must have the same length")
        s = self.scope(req.tenant)
        keys = s.keys(keys)
        kmin, kmax = s.key_min, s.max_key
        prefix = self._resv_prefix
        commit = self.dir.writes.commit_many
        if all(p.startswith(prefix) for p in placeholders):
            codes = commit(client_id, keys, placeholders, kmin, kmax)
        else:  # another master's (a failover or restart lost them): those are not found
            ours = [i for i, p in enumerate(placeholders) if p.startswith(prefix)]
            codes = [int(ErrorCode.OBJECT_NOT_FOUND)] * len(keys)
            got = commit(client_id, [keys[i] for i in ours], [placeholders[i] for i in ours],
                         kmin, kmax)
            for i, code in zip(ours, got, strict=True):
                codes[i] = code
        self.count("put_end", codes)
        if req.reserve:
            return self._reserve_many(client_id, req.reserve, req.reserve_count, codes)
        return BatchReserveReply(codes)

    # ================================================================ revoke
    def put_revoke(self, req: PutRevoke) -> Empty:
        key = req.key  # the caller's own put in flight: a placeholder too
        s = self.scope(req.tenant)
        code = self.dir.writes.revoke_many(self.check_client(req.client_id), s.own_keys((key,)),
                                           s.max_key)[0]
        self.fail(code, "put_revoke", key)
        return Empty()

    def batch_put_revoke(self, req: BatchPutRevoke) -> BatchKeysReply:
        client_id = self.check_client(req.client_id)
        keys = req.keys
        self.check_batch(keys)
        s = self.scope(req.tenant)
        codes = self.dir.writes.revoke_many(client_id, s.own_keys(keys), s.max_key)
        self.count("put_revoke", codes)
        return BatchKeysReply(codes)

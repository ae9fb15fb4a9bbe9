"""The handlers of the read ops: GET_REPLICA_LIST, EXIST, GET_SIZE and their
batch forms.

A read grants a read lease on what it finds (:class:`Reads`); a replica
served from disk may be promoted into memory by the SSD tier, which sees
each disk hit as a read of that key alone would show it (the directory's
pass stops at it and resumes after the hook). A single-key op is its batch
form's core run on one key; its reply signs its replicas directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.core.capability import CapOp
from kvpool.core.protocol import (
    BatchExist,
    BatchExistReply,
    BatchGetReplicaList,
    BatchGetReplicaListReply,
    BatchGetSize,
    BatchGetSizeReply,
    Exist,
    ExistReply,
    GetReplicaList,
    GetReplicaListReply,
    GetSize,
    GetSizeReply,
    ReplicaStatus,
    SegmentDescriptor,
)
from kvpool.master.grants import describe
from kvpool.master.keys import INVALID_KEY
from kvpool.master.op_group import OpGroup

__all__ = ["ReadOps"]

_COMPLETE = ReplicaStatus.COMPLETE
_CAP_READ = int(CapOp.READ)


class ReadOps(OpGroup):
    """Where objects are, whether they exist, their sizes."""

    def get_replica_list(self, req: GetReplicaList) -> GetReplicaListReply:
        s = self.scope(req.tenant)
        key = req.key if s.default else s.prefix + req.key  # (Scope.key, inline)
        d = self.dir
        codes = [0]
        objs: list[Any] = [None]
        found: list[Any] = [None]
        if not d.reads.get_replicas_many((key,), 0, codes, objs, found, False, s.key_min,
                                         s.max_key):  # a disk hit
            self.tiering.on_disk_hit(d, key, objs[0], found[0])
        code = codes[0]
        if code:
            if code != INVALID_KEY:
                self.count_one("get_replica_list")
            self.fail(code, "get_replica_list", req.key)
        self.count_one("get_replica_list")
        obj = objs[0]
        replicas, segs, caps = self.granter.granted(found[0], obj.size, _COMPLETE, _CAP_READ)
        return GetReplicaListReply(obj.size, self.cfg.lease_ttl_ms, replicas, obj.checksum,
                                   segs, caps)

    def batch_get_replica_list(self, req: BatchGetReplicaList) -> BatchGetReplicaListReply:
        keys: Sequence[str] = req.keys
        self.check_batch(keys)
        n = len(keys)
        s = self.scope(req.tenant)
        if not s.default:
            keys = s.keys(keys)
        d = self.dir
        many = d.reads.get_replicas_many
        codes = [0] * n
        objs: list[Any] = [None] * n
        found: list[Any] = [None] * n  # the flat replicas served
        kmin, kmax = s.key_min, s.max_key
        # one pass of the directory, paused at each disk hit for the tier's hook
        i = many(keys, 0, codes, objs, found, False, kmin, kmax)
        while i < n:
            self.tiering.on_disk_hit(d, keys[i], objs[i], found[i])
            i = many(keys, i + 1, codes, objs, found, False, kmin, kmax)
        sizes = [0] * n
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
        segs: dict[str, SegmentDescriptor] = {}
        grants = self.granter.grants(_CAP_READ)
        out = describe(found, sizes, _COMPLETE, segs, grants)
        self.count("get_replica_list", codes)
        return BatchGetReplicaListReply(codes, sizes, out, self.cfg.lease_ttl_ms,
                                        checksums or [], segs, grants.sign())

    def exist(self, req: Exist) -> ExistReply:
        self.count_one("exist")
        codes = [0]
        found: list[Any] = [None]
        s = self.scope(req.tenant)
        key = req.key
        self.dir.reads.get_replicas_many((key if s.default else s.prefix + key,), 0, codes, [None],
                                         found, True, s.key_min, s.max_key)
        if codes[0]:
            self.fail(codes[0], "exist", req.key)
        return ExistReply(found[0] is not None)

    def batch_exist(self, req: BatchExist) -> BatchExistReply:
        keys = req.keys
        self.check_batch(keys)
        s = self.scope(req.tenant)
        codes, found = self.dir.reads.exist_many(s.keys(keys), s.key_min, s.max_key)
        self.count("exist", codes)
        return BatchExistReply(codes, found)

    def get_size(self, req: GetSize) -> GetSizeReply:
        s = self.scope(req.tenant)
        codes, sizes = self.dir.reads.sizes_many((s.key(req.key),), s.key_min, s.max_key)
        self.fail(codes[0], "get_size", req.key)
        return GetSizeReply(sizes[0])

    def batch_get_size(self, req: BatchGetSize) -> BatchGetSizeReply:
        keys = req.keys
        self.check_batch(keys)
        s = self.scope(req.tenant)
        codes, sizes = self.dir.reads.sizes_many(s.keys(keys), s.key_min, s.max_key)
        self.count("get_size", codes)
        return BatchGetSizeReply(codes, sizes)

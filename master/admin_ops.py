"""The handlers of removal, listing and the master's own state: REMOVE,
BATCH_REMOVE, BATCH_REPLICA_CLEAR, REMOVE_ALL, REMOVE_BY_REGEX,
LIST_OBJECTS, STATS, LOCAL_ENDPOINT."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

from kvpool.core import __version__
from kvpool.core.protocol import (
    BatchKeysReply,
    BatchRemove,
    BatchReplicaClear,
    Empty,
    ListObjects,
    ListObjectsReply,
    LocalEndpoint,
    LocalEndpointReply,
    Remove,
    RemoveAll,
    RemoveAllReply,
    RemoveByRegex,
    SegmentKind,
    Stats,
    StatsReply,
)
from kvpool.core.tenants import TENANT_SEP
from kvpool.master.events import list_objects
from kvpool.master.keys import Scope
from kvpool.master.op_group import OpGroup, bad
from kvpool.master.segments import SegState

__all__ = ["AdminOps"]

_STATS_FIELDS = frozenset(StatsReply.__struct_fields__)
_DEAD = SegState.DEAD
_FILE = SegmentKind.FILE
#: STATS fields that count what happened to the pool's objects (any tenant's)
_POOL_HISTORY = ("evictions", "evicted_bytes", "lease_refusals", "preemptions", "spilled",
                 "held_puts", "held_bytes", "replaced", "soft_pinned", "groups", "restore_unloaded")


class AdminOps(OpGroup):
    """Removal, listing, counters."""

    def remove(self, req: Remove) -> Empty:
        s = self.scope(req.tenant)
        self.fail(self.dir.removal.remove_many((s.key(req.key),), req.force, s.key_min,
                                               s.max_key)[0], "remove", req.key)
        return Empty()

    def batch_remove(self, req: BatchRemove) -> BatchKeysReply:
        self.check_batch(req.keys)
        s = self.scope(req.tenant)
        codes = self.dir.removal.remove_many(s.keys(req.keys), req.force, s.key_min, s.max_key)
        self.count("remove", codes)
        return BatchKeysReply(codes)

    def batch_replica_clear(self, req: BatchReplicaClear) -> BatchKeysReply:
        client_id = self.check_client(req.client_id)
        self.check_batch(req.keys)
        s = self.scope(req.tenant)
        codes = self.dir.removal.clear_many(client_id, s.keys(req.keys), req.segment_id,
                                            s.key_min, s.max_key)
        self.count("replica_clear", codes)
        return BatchKeysReply(codes)

    def _remove_matching(self, s: Scope, match: Callable[[str], bool] | None, force: bool,
                         prefix: str = "", exclude_prefix: str = "") -> int:
        """Remove tenant ``s``'s objects as :meth:`Removal.remove_matching`
        says (``prefix``, ``exclude_prefix`` and ``match`` on the caller's
        keys): a tenant's keys are those under its namespace, the default
        tenant's those under none."""
        if not s.default:
            return self.dir.removal.remove_matching(
                match, force, s.prefix + prefix, s.prefix + exclude_prefix if exclude_prefix
                else "")
        exclude: str | tuple[str, ...] = (TENANT_SEP, exclude_prefix) if exclude_prefix \
            else TENANT_SEP
        return self.dir.removal.remove_matching(match, force, prefix, exclude)

    def remove_all(self, req: RemoveAll) -> RemoveAllReply:
        return RemoveAllReply(self._remove_matching(self.scope(req.tenant), None, req.force))

    def remove_by_regex(self, req: RemoveByRegex) -> RemoveAllReply:
        s = self.scope(req.tenant)
        if len(req.pattern) > self.max_key:
            raise bad(f"pattern longer than max_key_length {self.max_key}")
        try:
            search = re.compile(req.pattern).search
        except re.error as exc:
            raise bad(f"bad pattern {req.pattern!r}: {exc}") from None
        removed = self._remove_matching(s, lambda k: search(k) is not None, req.force,
                                        req.prefix, req.exclude_prefix)
        self.count("remove", [0] * removed)
        return RemoveAllReply(removed)

    def list_objects(self, req: ListObjects) -> ListObjectsReply:
        s = self.scope(req.tenant)
        self.count_one("list_objects")
        return list_objects(self.dir, req, self.info.events_position(s.tenant), s.prefix)

    def local_endpoint(self, req: LocalEndpoint) -> LocalEndpointReply:
        ep = self.info.local_endpoint()
        return LocalEndpointReply() if ep is None else LocalEndpointReply(*ep)

    def _tenant_stats(self, s: Scope, d: dict[str, Any]) -> dict[str, Any]:
        """STATS as a tenant other than default sees it: its own objects,
        puts in flight and bytes stored (one pass over the table), the
        pool's capacities, segments and clients; every counter of what
        happened to any tenant's objects (evictions, lease refusals,
        replacements, groups, the SSD tier's and the directory's extra
        counters) zero, so nothing tells of other tenants' objects."""
        owns = s.owns
        mem = fil = n = 0
        for key, obj in self.dir.objects.items():
            if not owns(key):
                continue
            n += 1
            reps = obj.replicas
            for i in range(0, len(reps), 2):
                seg = reps[i]
                if seg.state != _DEAD:
                    if seg.kind == _FILE:
                        fil += obj.size
                    else:
                        mem += obj.size
        d.update(objects=n, pending=sum(1 for k in self.dir.objects.pending if owns(k)),
                 memory_used=mem, file_used=fil, bytes_used=mem + fil)
        for k in _POOL_HISTORY:
            if k in d:
                d[k] = 0
        for k in [k for k in d if k not in _STATS_FIELDS]:
            del d[k]
        return d

    def stats(self, req: Stats | None = None) -> StatsReply:
        s = self.scope(req.tenant) if req is not None else self.scopes.default
        d = dict(self.dir.stats())
        if not s.default:
            d = self._tenant_stats(s, d)
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
            restored_objects=loop.restored_objects if s.default else 0,
            restore_s=loop.restore_s,
            max_loop_ms=loop.max_loop_ms,
            journal_seq=loop.journal_seq, local_rpc_requests=local_requests,
            local_rpc_connections=local_conns,
            tiering=dict(self.tiering.stats()) if s.default else {}, extra=extra)


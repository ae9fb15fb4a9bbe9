"""The handlers of removal, listing and the master's own state: REMOVE,
BATCH_REMOVE, BATCH_REPLICA_CLEAR, REMOVE_ALL, REMOVE_BY_REGEX,
LIST_OBJECTS, STATS, LOCAL_ENDPOINT."""

from __future__ import annotations

import os
import re
import time

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
    Stats,
    StatsReply,
)
from kvpool.master.events import list_objects
from kvpool.master.op_group import OpGroup, bad

__all__ = ["AdminOps"]

_STATS_FIELDS = frozenset(StatsReply.__struct_fields__)


class AdminOps(OpGroup):
    """Removal, listing, counters."""

    def remove(self, req: Remove) -> Empty:
        self.fail(self.dir.removal.remove_many((req.key,), req.force)[0], "remove", req.key)
        return Empty()

    def batch_remove(self, req: BatchRemove) -> BatchKeysReply:
        self.check_batch(req.keys)
        codes = self.dir.removal.remove_many(req.keys, req.force)
        self.count("remove", codes)
        return BatchKeysReply(codes)

    def batch_replica_clear(self, req: BatchReplicaClear) -> BatchKeysReply:
        client_id = self.check_client(req.client_id)
        self.check_batch(req.keys)
        codes = self.dir.removal.clear_many(client_id, req.keys, req.segment_id)
        self.count("replica_clear", codes)
        return BatchKeysReply(codes)

    def remove_all(self, req: RemoveAll) -> RemoveAllReply:
        return RemoveAllReply(self.dir.removal.remove_matching(None, req.force))

    def remove_by_regex(self, req: RemoveByRegex) -> RemoveAllReply:
        if len(req.pattern) > self.max_key:
            raise bad(f"pattern longer than max_key_length {self.max_key}")
        try:
            search = re.compile(req.pattern).search
        except re.error as exc:
            raise bad(f"bad pattern {req.pattern!r}: {exc}") from None
        removed = self.dir.removal.remove_matching(lambda k: search(k) is not None, req.force,
                                                   req.prefix, req.exclude_prefix)
        self.count("remove", [0] * removed)
        return RemoveAllReply(removed)

    def list_objects(self, req: ListObjects) -> ListObjectsReply:
        self.count_one("list_objects")
        return list_objects(self.dir, req, self.info.events_position())

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


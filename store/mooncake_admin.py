"""Mooncake's administrative calls on kvpool: segments, replica descriptors, tasks.

- ``get_replica_desc`` / ``batch_get_replica_desc``: where an object's
  complete replicas are (memory: offset in its segment and the owner's
  ``host:port``; disk: the SSD-tier file), from one master RPC (which grants
  a read lease, as Mooncake's query does);
- ``batch_replica_clear(keys, segment_name)``: clear the replicas of the
  keys this store wrote whose read lease has ended, on one segment or all
  (one master RPC, BATCH_REPLICA_CLEAR); the keys cleared are returned;
- copy/move tasks: the master's replica jobs (CREATE_COPY_TASK,
  CREATE_MOVE_TASK, QUERY_TASK), copied by the source replica's owner; task
  ids are Mooncake's UUID pairs ``(0, n)``; ``assigned_client`` is the
  copying client's id as a UUID pair;
- what has no kvpool model (mounting arbitrary files or extra shared-memory
  regions into a running client) returns Mooncake's NOT_SUPPORTED (-1012)
  after one log line; docs/mooncake_compat.md says which.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentKind
from kvpool.store.client import Location
from kvpool.store.mooncake_codes import INVALID, NOT_SUPPORTED, code_of, log
from kvpool.store.mooncake_core import MooncakeCore
from kvpool.store.mooncake_types import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    QueryTaskResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    TaskStatus,
    TaskType,
)

__all__ = ["AdminCalls", "not_supported"]

_NO_TASK = (0, 0)


def _uuid_pair(hex_id: str) -> tuple[int, int]:
    """A kvpool client id (a UUID's hex) as Mooncake's (high, low) pair."""
    try:
        n = int(hex_id, 16) & ((1 << 128) - 1)
    except ValueError:
        return _NO_TASK
    return n >> 64, n & ((1 << 64) - 1)


# why each call without a kvpool model returns NOT_SUPPORTED
_UNSUPPORTED = {
    "mount_segment": "segments are created by kvpool (memory: setup's global_segment_size; "
                     "disk: kvpool client --disk-dir)",
    "unmount_segment": "no segment was mounted by mount_segment",
    "allocate_and_mount_segment": "a client's memory segment is sized at setup",
    "unmount_and_free_segment": "see allocate_and_mount_segment",
    "unmount_local_disk_segment": "the SSD tier is mounted for the client's lifetime",
}


def not_supported(call: str) -> int:
    """NOT_SUPPORTED for Mooncake's ``call``, after a log line saying why."""
    log.warning("%s is not supported on kvpool: %s", call, _UNSUPPORTED[call])
    return NOT_SUPPORTED


class AdminCalls:
    """Replica-descriptor and task calls of one store (module docstring)."""

    def __init__(self, core: MooncakeCore) -> None:
        self._core = core

    # ------------------------------------------------------------------ replica descriptors

    def _descriptors(self, loc: Location) -> list[ReplicaDescriptor]:
        client = self._core.live()
        out: list[ReplicaDescriptor] = []
        for r in loc.replicas:
            desc = client.describe_segment(r.segment_id)
            # Mooncake names a replica's server by its owner's hostname:port,
            # which is what a Mooncake-compatible store's segment id is
            if r.segment_id.rsplit(":", 1)[-1].isdigit():
                endpoint = r.segment_id
            elif desc is not None and desc.endpoint:
                endpoint = f"{desc.host_id}:{desc.endpoint.rsplit(':', 1)[-1]}"
            else:
                endpoint = ""
            if desc is not None and desc.kind == SegmentKind.FILE:
                out.append(ReplicaDescriptor(
                    ReplicaStatus.COMPLETE, r.segment_id,
                    disk=DiskDescriptor(desc.name, r.length),
                    local=desc.host_id == client.host_id))
            else:
                out.append(ReplicaDescriptor(
                    ReplicaStatus.COMPLETE, r.segment_id,
                    memory=MemoryDescriptor(Descriptor(r.length, r.offset, endpoint))))
        return out

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """``{key: replicas}`` for the keys that exist (one master RPC)."""
        valid = self._core.valid_keys(keys)
        client = self._core.client
        if not valid or client is None:
            return {}
        try:
            locs = client.batch_locate([k for _, k in valid])
            return {keys[i]: self._descriptors(loc) for (i, _k), loc in zip(valid, locs,
                                                                             strict=True)
                    if loc.code == ErrorCode.OK}
        except KVPoolError as exc:
            log.debug("batch_get_replica_desc: %s", exc)
            return {}

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Clear the replicas of ``keys`` on segment ``segment_name`` ("": every
        replica, the object goes; a key's last replica going takes the object
        too). As Mooncake: only keys this store wrote, whose read lease has
        ended; the others (and missing or invalid keys) are skipped. Returns
        the keys cleared (one master RPC)."""
        client = self._core.client
        if not keys or client is None:
            return []
        valid = self._core.valid_keys(keys)
        try:
            codes = client.batch_replica_clear([k for _, k in valid], segment_name)
        except KVPoolError as exc:
            log.debug("batch_replica_clear: %s", exc)
            return []
        return [keys[i] for (i, _k), c in zip(valid, codes, strict=True) if c == ErrorCode.OK]

    # ------------------------------------------------------------------ copy / move tasks

    def _start_task(self, key: str, targets: Sequence[str],
                    source: str = "") -> tuple[tuple[int, int], int]:
        try:
            client = self._core.live()
            k = self._core.key(key)
            if source:
                tid = client.create_move_task(k, source, targets[0])
            else:
                tid = client.create_copy_task(k, list(targets))
        except KVPoolError as exc:
            return _NO_TASK, code_of(exc)
        return (0, tid), 0

    def create_copy_task(self, key: str, targets: Sequence[str]) -> tuple[tuple[int, int], int]:
        """Copy ``key``'s object onto each segment named in ``targets`` (segment
        names as ``get_hostname()`` gives them). ``(task_id, 0)``, or
        ``((0, 0), code)``: -704 missing key, -600 no or unknown target, -200
        no room on a target, -708 a task already copying it. Targets holding
        a replica are skipped. Poll :meth:`query_task` for the outcome."""
        return self._start_task(key, targets)

    def create_move_task(self, key: str, source: str,
                         target: str) -> tuple[tuple[int, int], int]:
        """Move ``key``'s replica from segment ``source`` to ``target``: as
        :meth:`create_copy_task`; -600 also when ``source`` holds no replica or
        equals ``target``."""
        if not source:
            return _NO_TASK, INVALID
        return self._start_task(key, [target], source)

    def query_task(self, task_id: tuple[int, int]) -> tuple[QueryTaskResponse | None, int]:
        """``(response, 0)`` or ``(None, code)``: TASK_NOT_FOUND (-1400) for an
        unknown id (or one from before a master restart)."""
        try:
            hi, lo = (int(x) for x in task_id)
            if hi:
                raise KVPoolError(f"no task {task_id}", ErrorCode.TASK_NOT_FOUND)
            r = self._core.live().query_task(lo)
        except (TypeError, ValueError):
            return None, INVALID
        except KVPoolError as exc:
            return None, code_of(exc)
        return QueryTaskResponse(
            (0, r.task_id), TaskType.REPLICA_MOVE if r.move else TaskType.REPLICA_COPY,
            TaskStatus(r.status), r.created_ms, r.updated_ms, _uuid_pair(r.executor),
            r.message), 0

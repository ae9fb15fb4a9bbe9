"""Replica choice: which replica a reader tries first.

:func:`nearest_first` is the one place that orders a key's replicas for a
reader (as Mooncake's ``SelectBestReplica``): complete replicas only, the
reader's own segment first, then memory on its host, memory on other hosts,
files last in the same order; a segment that failed a transfer lately
(:meth:`kvpool.transfer.registry.SegmentRegistry.suspect`) goes after all of
them, as does one the reader does not know. Reads try them in that order,
round k on the k-th (:mod:`kvpool.store.reads`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvpool.core.protocol import ReplicaDescriptor, ReplicaStatus, SegmentKind
from kvpool.transfer.registry import SegmentRegistry

__all__ = ["SUSPECT_S", "ReplicaLocation", "nearest_first", "rank", "replica_location"]

_COMPLETE = ReplicaStatus.COMPLETE
#: how long a segment that failed a transfer is tried last (its owner may have died)
SUSPECT_S = 10.0
_FILE = SegmentKind.FILE


def rank(registry: SegmentRegistry, segment_id: str, now: float = 0.0) -> int:
    """How near a replica on ``segment_id`` is to this process: 0 own segment,
    1 same-host memory, 2 remote memory, +3 for a file; 5 unknown, 10
    suspect (``now``: the monotonic time; 0.0 = read the clock if needed)."""
    desc = registry.get(segment_id)
    if desc is None:
        return 5
    until = registry.suspect_until(segment_id)
    if until and until > (now or time.monotonic()):
        return 10
    file = 3 if desc.kind == _FILE else 0
    if desc.client_id == registry.client_id:
        return file
    if desc.host_id == registry.host_id:
        return 1 + file
    return 2 + file


def nearest_first(registry: SegmentRegistry,
                  replicas: list[ReplicaDescriptor]) -> list[ReplicaDescriptor]:
    """The complete replicas of ``replicas``, nearest first (see :func:`rank`)."""
    if len(replicas) == 1:
        return replicas if replicas[0].status is _COMPLETE else []
    out = [r for r in replicas if r.status is _COMPLETE]
    if len(out) > 1:
        now = time.monotonic()
        out.sort(key=lambda r: rank(registry, r.segment_id, now))
    return out


@dataclass(frozen=True, slots=True)
class ReplicaLocation:
    """One complete replica as a reader sees it: segment, object size, the
    segment's host and kind (memory or file), and whether it is on this host
    (read through shared memory or the file) or another (over the network)."""

    segment_id: str
    size: int
    host_id: str
    kind: SegmentKind
    same_host: bool


def replica_location(registry: SegmentRegistry, r: ReplicaDescriptor,
                     size: int) -> ReplicaLocation:
    """Replica ``r`` of a ``size``-byte object as :class:`ReplicaLocation`."""
    desc = registry.get(r.segment_id)
    if desc is None:
        return ReplicaLocation(r.segment_id, size, "", SegmentKind.MEMORY, False)
    return ReplicaLocation(r.segment_id, size, desc.host_id, desc.kind,
                           desc.host_id == registry.host_id)

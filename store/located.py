"""Located objects: where a key's bytes can be read from, until when.

A :class:`Location` is one key as every read sees it: its code (OK, or why it
cannot be read), size, checksum, the end of its read lease, its complete
replicas nearest first and the capability tokens they point at. Every read
form of the store client locates its keys into Locations and reads them with
one loop (:mod:`kvpool.store.reads`).

Keys located once may be read later, possibly by another process of the same
host. A :class:`Located` is one BATCH_GET_REPLICA_LIST reply with the keys it
answers and the end of the read lease it granted. The reply carries every
replica's descriptor and the capability tokens (bearer grants) that cover
them, so whoever holds it can read those keys without asking the master
again, until the lease ends. vLLM's scheduler-side connector locates a
prefix's chunks to decide whether to load them; it hands the reply of the
first layer group's keys to the workers in the step's metadata, so the load
that the first layer waits for starts with the transfer, not with a second
locate of the same keys.

The lease's end is a ``time.monotonic()`` value, which only compares within
one boot of one host: :meth:`Located.usable` checks the host's boot id
before trusting it (a worker on another host locates again).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import BatchGetReplicaListReply, ReplicaDescriptor

__all__ = ["Located", "Location", "boot_id"]


class Location(msgspec.Struct):
    """One located key: ``code`` OK with its ``size``, ``checksum``, read-lease
    ``deadline`` (``time.monotonic()``), complete ``replicas`` nearest first
    and the capability tokens (``caps``) they point at; or why not."""

    code: ErrorCode
    size: int = 0
    checksum: str | None = None
    deadline: float = 0.0
    replicas: list[ReplicaDescriptor] = msgspec.field(default_factory=list)
    caps: list[bytes] = msgspec.field(default_factory=list)

_BOOT_ID: str | None = None


def boot_id() -> str:
    """This host's boot id ("" where the kernel does not say: never trusted)."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT_ID = f.read().strip()
        except OSError:
            _BOOT_ID = ""
    return _BOOT_ID


@dataclass(frozen=True)
class Located:
    """``reply`` answers ``keys`` in order; its read lease ends at ``deadline``
    (``time.monotonic()`` on the host whose boot id is ``boot``). Picklable."""

    keys: list[str]
    reply: BatchGetReplicaListReply
    deadline: float
    boot: str

    def usable(self, min_left_s: float) -> bool:
        """Whether a reader here may still use it: the same boot of this host,
        and at least ``min_left_s`` of the lease left."""
        return bool(self.boot) and self.boot == boot_id() and \
            self.deadline - time.monotonic() >= min_left_s

    def positions(self) -> dict[str, int]:
        """Key -> its position in the reply (the first, for a repeated key)."""
        where: dict[str, int] = {}
        for pos, k in enumerate(self.keys):
            where.setdefault(k, pos)
        return where

    def subset(self, keys: Iterable[str]) -> Located:
        """The answers for ``keys`` (those this reply has; others are left out),
        with the same lease, capability tokens and segments."""
        where = self.positions()
        picked = [where[k] for k in dict.fromkeys(keys) if k in where]
        r = self.reply
        reply = BatchGetReplicaListReply(
            codes=[r.codes[p] for p in picked], sizes=[r.sizes[p] for p in picked],
            replicas=[r.replicas[p] for p in picked], lease_ttl_ms=r.lease_ttl_ms,
            checksums=[r.checksums[p] for p in picked] if r.checksums else [],
            segments=r.segments, caps=r.caps)
        return Located([self.keys[p] for p in picked], reply, self.deadline, self.boot)

    @staticmethod
    def merge(parts: Sequence[Located]) -> Located | None:
        """One reply answering every part's keys (capability indices re-based
        onto the joined token list; the earliest lease end), or None when
        ``parts`` is empty or their hosts differ."""
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        if len({p.boot for p in parts}) != 1:
            return None
        keys: list[str] = []
        codes: list[int] = []
        sizes: list[int] = []
        replicas: list[list[ReplicaDescriptor]] = []
        caps: list[bytes] = []
        segments = {}
        checked = any(p.reply.checksums for p in parts)
        checksums: list[int | str | None] = []
        for p in parts:
            r = p.reply
            base = len(caps)
            caps.extend(r.caps)
            segments.update(r.segments)
            keys.extend(p.keys)
            codes.extend(r.codes)
            sizes.extend(r.sizes)
            replicas.extend([ReplicaDescriptor(d.segment_id, d.offset, d.length, d.status,
                                               d.cap + base if d.cap >= 0 else -1)
                             for d in reps] if base else reps for reps in r.replicas)
            if checked:
                checksums.extend(r.checksums or [None] * len(r.codes))
        reply = BatchGetReplicaListReply(
            codes=codes, sizes=sizes, replicas=replicas,
            lease_ttl_ms=min(p.reply.lease_ttl_ms for p in parts), checksums=checksums,
            segments=segments, caps=caps)
        return Located(keys, reply, min(p.deadline for p in parts), parts[0].boot)

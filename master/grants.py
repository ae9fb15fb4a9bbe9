"""Replies that grant replicas: their descriptors and capability tokens.

A reply that grants replicas (a put's, a read's, a tier task's) carries one
token per segment (and per ``MAX_RANGES`` ranges) in ``caps``; each replica
descriptor points at the token that covers it (:class:`Grants`). Signing is
per reply and segment, not per key; a reply of one replica signs it
directly (:meth:`Granter.granted`).
"""

from __future__ import annotations

import time
from typing import Any

from kvpool.core.capability import MAX_RANGES, CapabilitySigner, CapOp
from kvpool.core.protocol import ReplicaDescriptor, ReplicaStatus, SegmentDescriptor

__all__ = ["Granter", "Grants", "describe", "replica_descriptors"]

_CAP_WRITE = int(CapOp.WRITE)
_time_ns = time.time_ns  # capability expiry is wall-clock epoch ms (it crosses hosts)
_NO_REPLICAS: list[ReplicaDescriptor] = []  # shared by every failed key of a reply


def _never_open(_sid: str) -> None:
    return None


class Grants:
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


def replica_descriptors(reps: tuple[Any, ...], size: int, status: ReplicaStatus,
                        segs: dict[str, SegmentDescriptor],
                        grants: Grants) -> list[ReplicaDescriptor]:
    """Descriptors of the flat ``(segment, offset, ...)`` replicas, each
    pointing at the token that covers it; their segments added to ``segs``."""
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


def describe(placed: list[Any], sizes: list[int], status: ReplicaStatus,
             segs: dict[str, SegmentDescriptor], grants: Grants, one: bool = False) -> list[Any]:
    """:func:`replica_descriptors` of each key's flat replicas ``placed[i]``
    of ``sizes[i]`` bytes (None: no replicas), a single replica (the common
    case) inline: the token still filling for its segment is used as
    :meth:`Grants.slot` would. ``one`` (every key placed has one replica):
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
            out[i] = replica_descriptors(reps, size, status, segs, grants)
    return out


class Granter:
    """Makes the grants of replies: a WRITE grant lasts as long as the put may
    (``write_ttl_ms``: a big put over a slow link must not be cut off
    mid-way), a READ grant a read lease (``read_ttl_ms``)."""

    def __init__(self, signer: CapabilitySigner | None, read_ttl_ms: int,
                 write_ttl_ms: int) -> None:
        self.signer = signer
        self.read_ttl_ms = read_ttl_ms
        self.write_ttl_ms = write_ttl_ms

    def grants(self, op: int) -> Grants:
        """The tokens of a new reply granting ``op``."""
        ttl = self.write_ttl_ms if op == _CAP_WRITE else self.read_ttl_ms
        return Grants(self.signer, op, _time_ns() // 1_000_000 + ttl)

    def granted(self, reps: tuple[Any, ...], size: int, status: ReplicaStatus, op: int
                ) -> tuple[list[ReplicaDescriptor], dict[str, SegmentDescriptor], list[bytes]]:
        """(replicas, segments, caps) of one key's reply: what
        :func:`replica_descriptors` and :meth:`Grants.sign` give, with one
        replica (the common case) signed directly."""
        if len(reps) != 2:
            segs: dict[str, SegmentDescriptor] = {}
            grants = self.grants(op)
            return replica_descriptors(reps, size, status, segs, grants), segs, grants.sign()
        seg = reps[0]
        sid = seg.id
        off = reps[1]
        signer = self.signer
        if signer is None:
            return [ReplicaDescriptor(sid, off, size, status, -1)], {sid: seg.desc}, []
        exp = _time_ns() // 1_000_000 + (self.write_ttl_ms if op == _CAP_WRITE
                                         else self.read_ttl_ms)
        return ([ReplicaDescriptor(sid, off, size, status, 0)], {sid: seg.desc},
                [signer.grant_ranges(sid, (off, size), op, exp)])

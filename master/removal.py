"""Removal at a client's request: REMOVE, BATCH_REPLICA_CLEAR, REMOVE_ALL and
REMOVE_BY_REGEX.

A read-leased object is not removed (OBJECT_HAS_LEASE, counted in
``lease_refusals``) unless forced, and nothing is while every object counts
as leased (an HA leader's first lease TTL). A forced removal of a leased
object removes it at once but holds its space until the lease ends: the
READ capabilities granted with the lease name its byte ranges and stay
valid as long, so no later put (of any tenant) is placed where they still
read. Every removal is recorded (:class:`Remove`, or :class:`DropReplica`
for one tier's copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.protocol import KEY_MIN
from kvpool.master.config import MasterConfig
from kvpool.master.keys import DENIED, HAS_LEASE, NOT_FOUND, NOT_READY, valid_keys
from kvpool.master.objects import Obj, ObjectTable
from kvpool.master.records import DropReplica
from kvpool.master.segments import SegState

__all__ = ["Removal"]

_DEAD = SegState.DEAD


class Removal:
    """Removes objects, or one segment's replicas of them (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, clock: Callable[[], float], objects: ObjectTable,
                 hold: Callable[[tuple[Any, ...], int, float], None] | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.objects = objects
        #: (replicas, size, until): free at ``until`` (Writes.hold); None: free at once
        self.hold = hold
        self.lease_refusals = 0

    def _remove_forced(self, key: str, obj: Obj, now: float) -> None:
        """Remove ``obj`` regardless of its lease; its space is held until
        the lease (or an HA leader's first lease TTL) ends."""
        until = max(obj.lease, self.objects.lease_grace_until)
        hold = self.hold
        if hold is None or until <= now:
            self.objects.remove(key, obj)
        else:
            self.objects.remove(key, obj, lambda reps, size: hold(reps, size, until))

    def _leased(self, obj: Obj) -> bool:
        if max(obj.lease, self.objects.lease_grace_until) > self.clock():
            self.lease_refusals += 1
            return True
        return False

    def remove_many(self, keys: Sequence[str], force: bool = False, key_min: str = KEY_MIN,
                    max_key: int = 0) -> list[int]:
        """Remove each key's object; the per-key codes (INVALID_KEY,
        OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY: its put is in flight,
        OBJECT_HAS_LEASE: read-leased and not ``force``). ``key_min``/
        ``max_key`` (0: the configured length): the key check (a tenant's
        stored keys, :class:`~kvpool.master.keys.Scope`)."""
        codes = [0] * len(keys)
        objects = self.objects
        now = self.clock() if force else 0.0
        for i, key in valid_keys(keys, max_key or self.cfg.max_key_length, codes, key_min):
            obj = objects.get(key)
            if obj is None:
                codes[i] = NOT_READY if key in objects.pending else NOT_FOUND
            elif force:
                self._remove_forced(key, obj, now)
            elif self._leased(obj):
                codes[i] = HAS_LEASE
            else:
                objects.remove(key, obj)
        return codes

    def clear_many(self, client_id: str, keys: Sequence[str], segment_id: str = "",
                   key_min: str = KEY_MIN, max_key: int = 0) -> list[int]:
        """Clear each key's replicas on ``segment_id`` ("" = every replica: the
        object goes), as Mooncake's BatchReplicaClear; the per-key codes. Only
        the object's writer may (PERMISSION_DENIED; an object restored after
        a restart has no recorded writer: any client may), not while
        read-leased (OBJECT_HAS_LEASE); OBJECT_NOT_FOUND when missing (or in
        flight), or holding no replica on the segment. The last replica's
        clear removes the object. ``key_min``/``max_key``: as :meth:`remove_many`."""
        codes = [0] * len(keys)
        for i, key in valid_keys(keys, max_key or self.cfg.max_key_length, codes, key_min):
            codes[i] = self._clear(client_id, key, segment_id)
        return codes

    def _clear(self, client_id: str, key: str, segment_id: str) -> int:
        objects = self.objects
        obj = objects.get(key)
        if obj is None:
            return NOT_FOUND
        if obj.writer and obj.writer != client_id:
            return DENIED
        if self._leased(obj):
            return HAS_LEASE
        if not segment_id:
            objects.remove(key, obj)
            return 0
        reps = obj.replicas
        kept: list[Any] = []
        gone: list[Any] = []
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.id == segment_id and seg.state != _DEAD:
                gone += (seg, reps[i + 1])
            elif seg.state != _DEAD:
                kept += (seg, reps[i + 1])
        if not gone:
            return NOT_FOUND
        if not kept:
            objects.remove(key, obj)
            return 0
        tenants = objects.tenants
        if key < " " or tenants.track_default:
            tenants.rereps(key, obj.size, reps, tuple(kept))
        obj.replicas = tuple(kept)
        gone[0].keys.discard(key)
        objects.segtab.free(tuple(gone), obj.size)
        changes = objects.changes
        if changes.journaling:
            changes.records.append(DropReplica(key, segment_id))
        return 0

    def remove_matching(self, match: Callable[[str], bool] | None, force: bool = False,
                        prefix: str = "", exclude_prefix: str | tuple[str, ...] = "") -> int:
        """Remove every complete object whose key starts with ``prefix``, does
        not start with ``exclude_prefix`` (when given; a tuple: any of them)
        and, with ``prefix``
        stripped, satisfies ``match`` (None: every key); leased ones only
        with ``force``. One pass over the table. Return the count removed."""
        now = self.clock()
        objects = self.objects
        if not force and objects.lease_grace_until > now:
            return 0  # every object counts as leased
        cut = len(prefix)
        victims = [(k, o) for k, o in objects.items()
                   if (force or o.lease <= now) and k.startswith(prefix)
                   and not (exclude_prefix and k.startswith(exclude_prefix))
                   and (match is None or match(k[cut:]))]
        for k, o in victims:
            self._remove_forced(k, o, now)
        return len(victims)

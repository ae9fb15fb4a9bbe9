"""The read path: where a batch of objects' replicas are, and whether they exist.

One loop serves GET_REPLICA_LIST and EXIST (:meth:`Reads.get_replicas_many`): a key's
object is found, its replicas chosen, and, when it is found, it gets a
fresh read lease (a grouped object leases its whole group) and moves to the
most recent end of the LRU; a single key is a batch of one. The replicas a
read gets are its object's ACTIVE ones, else (only a suspect owner holds
it: its memory may well be there) its SUSPECT ones; an object held only by
segments awaiting their owner is REPLICA_IS_NOT_READY. An EXIST is true for
an object with any replica not dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.protocol import KEY_MIN, SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.keys import NOT_FOUND, NOT_READY, mark_bad_keys, valid_keys
from kvpool.master.objects import TICKS, Obj, ObjectTable
from kvpool.master.segments import SegState

__all__ = ["Reads"]

_FILE = SegmentKind.FILE
_ACTIVE = SegState.ACTIVE
_SUSPECT = SegState.SUSPECT
_DEAD = SegState.DEAD


class Reads:
    """Lookups over the object table (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, clock: Callable[[], float],
                 objects: ObjectTable) -> None:
        self.clock = clock
        self.objects = objects
        self.shards, self.mask = objects.shards, objects.mask  # (fixed for its life)
        self.max_key = cfg.max_key_length
        self.lease_s = cfg.lease_ttl_ms / 1000.0

    def get_replicas_many(self, keys: Sequence[str], start: int, codes: list[int],
                          objs: list[Any], found: list[Any], exist: bool = False,
                          key_min: str = KEY_MIN, max_key: int = 0) -> int:
        """The one read loop: locate ``keys[start:]`` into ``codes``
        (INVALID_KEY, OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY), ``objs`` (the
        object) and ``found`` (its flat replicas a reader gets) at each key's
        index. Returns the index of the first key served from a disk replica,
        which ends the pass (``len(keys)`` when none): the caller runs its
        disk-hit hook (a promotion may place and evict) and resumes after it,
        so the hook sees what a read of that key alone would. ``codes`` past
        ``start`` must be 0 on the first call (``start`` 0). ``exist``:
        EXIST's choice of replicas, no code but INVALID_KEY, no stop at a
        disk hit (:meth:`exist_many`). ``key_min``/``max_key`` (0: the
        configured length): the key check (a tenant's stored keys,
        :class:`~kvpool.master.keys.Scope`)."""
        objects = self.objects
        if objects.unloaded is not None and start == 0:
            objects.force(keys)  # (before the shards are indexed inline)
        shards = self.shards
        mask = self.mask
        grouped = objects.group_of
        tick = TICKS.__next__
        n = len(keys)
        # the first pass checks every key (C speed); a resumed pass finds the
        # bad ones already marked
        max_key = max_key or self.max_key
        bad = start > 0 or ((n != 1 or keys[0] < key_min or len(keys[0]) > max_key)
                            and mark_bad_keys(keys, max_key, codes, key_min))
        now = self.clock()
        lease = now + self.lease_s
        misses = 0
        hits = 0
        for i in range(start, n):
            if bad and codes[i]:
                continue
            key = keys[i]
            shard = shards[hash(key) & mask]
            obj = shard.get(key)
            if obj is None:
                misses += 1
                if not exist:
                    codes[i] = NOT_READY if key in objects.pending else NOT_FOUND
                continue
            reps = obj.replicas
            if len(reps) != 2 or (seg := reps[0]).state is not _ACTIVE or seg.kind is _FILE:
                code, reps = self._locate(obj, exist)
                if code:
                    misses += 1
                    if not exist:
                        codes[i] = code
                    continue
            if grouped and key in grouped:
                objects.lease_group(key, obj, lease, now)
            obj.lease = lease
            obj.tick = tick()
            del shard[key]
            shard[key] = obj  # LRU: most recent at the end of its shard
            hits += 1
            objs[i] = obj
            found[i] = reps
            if reps[0].kind is _FILE and not exist:
                objects.tenants.reads(key_min, hits, misses)
                return i
        # a pass's hits and misses count for the tenant of its keys (a
        # request's keys are one tenant's, named by the scope's key_min)
        if start < n:
            objects.tenants.reads(key_min, hits, misses)
        return n

    def exist_many(self, keys: Sequence[str], key_min: str = KEY_MIN,
                   max_key: int = 0) -> tuple[list[int], list[bool]]:
        """Whether each key exists: (codes, found); code INVALID_KEY (found
        False) for an empty, too long or reserved key, else 0."""
        n = len(keys)
        codes = [0] * n
        found: list[Any] = [None] * n
        self.get_replicas_many(keys, 0, codes, [None] * n, found, True, key_min, max_key)
        return codes, list(map(bool, found))  # (flat replicas are never empty)

    @staticmethod
    def _locate(obj: Obj, exist: bool) -> tuple[int, Any]:
        """(0, the replicas a reader of ``obj`` gets), or (code, None)."""
        reps = obj.replicas
        if exist:
            if not any(s.state != _DEAD for s in reps[::2]):
                return NOT_FOUND, None
            return 0, reps
        if len(reps) != 2 or reps[0].state != _ACTIVE:
            reps = tuple(x for i in range(0, len(reps), 2) if reps[i].state == _ACTIVE
                         for x in (reps[i], reps[i + 1]))
            if not reps:
                # only a suspect owner holds it: its memory may well be there
                # (a busy process, a same-host shm read needs no owner CPU)
                all_reps = obj.replicas
                reps = tuple(x for i in range(0, len(all_reps), 2)
                             if all_reps[i].state == _SUSPECT
                             for x in (all_reps[i], all_reps[i + 1]))
            if not reps:
                if all(r.state == _DEAD for r in obj.replicas[::2]):
                    return NOT_FOUND, None
                return NOT_READY, None
        return 0, reps

    def sizes_many(self, keys: Sequence[str], key_min: str = KEY_MIN,
                   max_key: int = 0) -> tuple[list[int], list[int]]:
        """Each key's object size: (codes, sizes); size 0 where the code is not
        OK (INVALID_KEY, OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY: in flight)."""
        n = len(keys)
        codes = [0] * n
        sizes = [0] * n
        get = self.objects.get
        pending = self.objects.pending
        for i, key in valid_keys(keys, max_key or self.max_key, codes, key_min):
            obj = get(key)
            if obj is None:
                codes[i] = NOT_READY if key in pending else NOT_FOUND
            else:
                sizes[i] = obj.size
        return codes, sizes

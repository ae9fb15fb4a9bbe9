"""Eviction: which objects go when a pool is full (a policy), and their going
(the evictor).

:class:`EvictionPolicy` chooses (as vLLM's ``CachePolicy.evict``): victims
freeing enough bytes of one pool, or None. :class:`Lru` is the master's:
approximately least recently used first (the object table's shards merged
by use tick, up to ``eviction_max_scan`` objects looked at), never a leased
or hard-pinned object, soft-pinned ones only after every other, a grouped
object with the evictable members of its group.

:class:`Evictor` runs it: above the high watermark a pool is evicted down
to ``eviction_ratio`` below it (``eviction_batch`` objects per call, the
rest in later loop turns: no stall), and a put that finds no room asks for
what it needs. Each victim passes the tier hooks first (the SSD tier may
take it: an offload to disk); the rest lose their replicas in that pool,
and an object left without replicas goes (recorded).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvpool.core.protocol import SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.objects import HARD_PIN, SOFT_PIN, Obj, ObjectTable
from kvpool.master.records import DropReplica
from kvpool.master.segments import SegmentTable, SegState

if TYPE_CHECKING:
    from kvpool.master.directory import Directory

__all__ = ["EvictionPolicy", "Evictor", "Lru", "Victims"]

log = logging.getLogger(__name__)

_ACTIVE = SegState.ACTIVE
_DEAD = SegState.DEAD
_MEM = SegmentKind.MEMORY

#: ``(victims, cut)``: the ``(key, object)`` pairs chosen, and whether the
#: choice stopped at the object limit (more may be evictable)
Victims = tuple[list[tuple[str, Obj]], bool]


class EvictionPolicy(ABC):
    """Chooses what to evict from one pool."""

    @abstractmethod
    def evict(self, kind: SegmentKind, to_free: float, limit: int, now: float,
              items: Iterable[tuple[str, Obj]] | None = None,
              only: Callable[[str, Obj], bool] | None = None) -> Victims | None:
        """Objects with replicas in pool ``kind`` whose replicas there free at
        least ``to_free`` bytes (as far as any can), at most ``limit`` of them
        unless a group must go whole. None when nothing is evictable.
        Atomic: if None is returned, no state changes are made; otherwise
        the only change is that an expired soft pin of a victim is cleared.

        ``items``: the candidates in use order (least recent first) instead
        of the whole table's: one tenant's objects (its quota); grouped
        objects are then skipped (a group may span tenants). ``only``: a
        candidate goes only if ``only(key, obj)`` (pool-wide eviction's pass
        over the tenants above their guaranteed share)."""


class Lru(EvictionPolicy):
    """Approximate LRU over the object table (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, objects: ObjectTable, segtab: SegmentTable) -> None:
        self.max_scan = cfg.eviction_max_scan
        self.objects = objects
        self.segtab = segtab

    def evict(self, kind: SegmentKind, to_free: float, limit: int, now: float,
              items: Iterable[tuple[str, Obj]] | None = None,
              only: Callable[[str, Obj], bool] | None = None) -> Victims | None:
        objects = self.objects
        pool_bytes = self.segtab.pool_bytes
        grouped = objects.group_of
        soft_until = objects.soft_until
        victims: list[tuple[str, Obj]] = []
        taken: set[str] = set()
        soft: list[tuple[str, Obj]] = []
        freed = 0
        scanned = 0
        cut = False
        own = items is not None
        for key, obj in (objects.lru_items() if items is None else items):
            scanned += 1
            if scanned > self.max_scan:
                break
            if obj.flags & HARD_PIN or obj.lease > now:
                continue
            if own and grouped and key in grouped:
                continue
            b = pool_bytes(obj.replicas, obj.size, kind)
            if not b:
                continue
            if obj.flags & SOFT_PIN:
                if soft_until.get(key, 0.0) > now:
                    soft.append((key, obj))
                    continue
                obj.flags &= ~SOFT_PIN  # its pin ended: ordinary cache now
                soft_until.pop(key, None)
            if key in taken:  # a group member taken with an earlier victim
                continue
            if only is not None and not only(key, obj):
                continue
            victims.append((key, obj))
            freed += b
            if grouped and key in grouped:
                freed += self._group(key, kind, now, victims, taken)
            if freed >= to_free:
                break
            if len(victims) >= limit:
                cut = True
                break
        if not cut:
            for key, obj in soft:
                if freed >= to_free or len(victims) >= limit:
                    break
                if only is not None and not only(key, obj):
                    continue
                victims.append((key, obj))
                freed += pool_bytes(obj.replicas, obj.size, kind)
        return (victims, cut) if victims else None

    def _group(self, key: str, kind: SegmentKind, now: float,
               victims: list[tuple[str, Obj]], taken: set[str]) -> int:
        """Grouped ``key`` was picked: add the other members of its group that
        are evictable on their own (not leased, not pinned, not chosen yet,
        with bytes in pool ``kind``) to ``victims`` and ``taken``; return
        their bytes."""
        objects = self.objects
        chosen = {k for k, _ in victims}
        get = objects.get
        soft = objects.soft_until
        pool_bytes = self.segtab.pool_bytes
        added = 0
        for member in objects.groups[objects.group_of[key]]:
            obj = get(member)
            if obj is None or member in chosen or obj.lease > now or obj.flags & HARD_PIN \
                    or (obj.flags & SOFT_PIN and soft.get(member, 0.0) > now):
                continue
            b = pool_bytes(obj.replicas, obj.size, kind)
            if b:
                victims.append((member, obj))
                taken.add(member)
                added += b
        return added


class Evictor:
    """Runs the eviction policy over the pools (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, clock: Callable[[], float], segtab: SegmentTable,
                 objects: ObjectTable, policy: EvictionPolicy) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segtab = segtab
        self.objects = objects
        self.policy = policy
        self.directory: Directory | None = None  # the tier hooks' argument (set by it)
        self.evicting: set[SegmentKind] = set()  # pools whose eviction continues
        self.evictions = 0
        self.evicted_bytes = 0
        self.tenants = objects.tenants

    def evict(self, kind: SegmentKind, need: int = 0) -> int:
        """Evict from pool ``kind`` until usage is ``eviction_ratio`` below the
        high watermark and at least ``need`` bytes were freed. Return bytes freed.

        Without ``need`` (watermark eviction) at most ``eviction_batch``
        objects go per call; if the pool is still above target it is left in
        ``evicting`` and the loop continues with :meth:`step` (no stall)."""
        segtab = self.segtab
        cap = segtab.pool_cap[kind]
        if cap <= 0:
            self.evicting.discard(kind)
            return 0
        cfg = self.cfg
        target = max(0.0, cfg.eviction_high_watermark - cfg.eviction_ratio) * cap
        to_free = max(segtab.pool_used[kind] - target, need)
        if to_free <= 0:
            self.evicting.discard(kind)
            return 0
        now = self.clock()
        if self.objects.lease_grace_until > now:  # every object counts as leased
            self.evicting.discard(kind)
            return 0
        limit = (1 << 62) if need else cfg.eviction_batch
        actual = 0
        tenants = self.tenants
        if tenants.guarantees and kind is _MEM:
            # first the tenants above their guaranteed share
            first = self.policy.evict(kind, to_free, limit, now, None, tenants.over_share())
            for key, obj in first[0] if first is not None else ():
                actual += self.evict_object(key, obj, kind)
            to_free -= actual
        chosen = self.policy.evict(kind, to_free, limit, now) if to_free > 0 else None
        victims, cut = chosen if chosen is not None else ([], False)
        for key, obj in victims:
            actual += self.evict_object(key, obj, kind)
        if victims:
            log.debug("evicted %d objects (%d B) from %s pool", len(victims), actual, kind.name)
        if cut and actual and segtab.pool_used[kind] > target:
            self.evicting.add(kind)  # continue in the next loop iteration
        else:
            self.evicting.discard(kind)
        return actual

    def step(self) -> int:
        """Continue watermark eviction (one batch per pool); return bytes freed."""
        return sum(self.evict(kind) for kind in list(self.evicting))

    def evict_object(self, key: str, obj: Obj, kind: SegmentKind, offload: bool = True) -> int:
        """Free ``obj``'s replicas in pool ``kind`` (unless the tier hooks took
        it; never with ``offload`` False: a tenant's quota needs the room
        now); remove the object when no replica is left. Return bytes freed."""
        d = self.directory
        if offload and d is not None and d.hooks.on_evict(d, key, obj, kind):
            return 0
        tenants = self.tenants
        if key < " " or tenants.track_default:
            t = tenants.of(key)
            if t is not None:
                t.evictions += 1
        segtab = self.segtab
        reps = obj.replicas
        kept: list[Any] = []
        gone: list[Any] = []
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.kind == kind and seg.state == _ACTIVE:
                gone += (seg, reps[i + 1])
            elif seg.state != _DEAD:
                kept += (seg, reps[i + 1])
        before = segtab.pool_used[kind]
        self.evictions += 1
        if not kept:
            self.objects.remove(key, obj)
        else:
            if key < " " or tenants.track_default:
                tenants.rereps(key, obj.size, reps, tuple(kept))
            obj.replicas = tuple(kept)
            changes = self.objects.changes
            for i in range(0, len(gone), 2):
                gone[i].keys.discard(key)
                if changes.journaling:
                    changes.records.append(DropReplica(key, gone[i].id))
            segtab.free(tuple(gone), obj.size)
        freed = before - segtab.pool_used[kind]
        self.evicted_bytes += freed
        return freed

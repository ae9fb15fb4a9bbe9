"""The object table: complete objects, puts in flight, pins, groups and leases.

Memory layout (the 1M-object target is <= 400 B/object): an object is a
msgspec Struct without a GC header whose ``replicas`` is one flat tuple
``(segment, offset, segment, offset, ...)`` (every replica has the object's
length); the table is 256 insertion-ordered dict shards, each an LRU list (a
read moves the key to the end of its shard and stamps it with a global use
tick; eviction merges the shard fronts by tick: global LRU order). Shards
let a snapshot copy keys one shard at a time instead of 1M keys at once.
Segments keep the set of keys that have a replica on them, so dropping a
segment touches only its own objects, in bounded slices (:meth:`purge_step`).

Beside the objects: the puts in flight (``pending``), soft pin deadlines
(``soft_until``: not journaled, a restored soft-pinned object is ordinary
cache, as Mooncake's) and object groups (Mooncake's ``group_ids``: a read of
a member leases every member, eviction takes a group's evictable members
together; in memory only, after a restart objects are ungrouped).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import msgspec

from kvpool.core.errors import KVPoolError
from kvpool.master.records import Changes, Put, Remove
from kvpool.master.segments import Segment, SegmentTable, SegState
from kvpool.master.unloaded import Unloaded, release_heap

if TYPE_CHECKING:
    from kvpool.master.tenants import TenantTable

__all__ = ["HARD_PIN", "SOFT_PIN", "TICKS", "Obj", "ObjectTable", "Pending"]

log = logging.getLogger(__name__)

HARD_PIN = 1
SOFT_PIN = 2

#: Monotonic use counter shared by every object: each shard is in use order,
#: so merging the shards by tick yields exact global LRU order.
TICKS = itertools.count(1)
_DEAD = SegState.DEAD


class Obj(msgspec.Struct, gc=False, eq=False):
    """A COMPLETE object. ``replicas`` = (segment, offset, segment, offset, ...).
    ``writer``: the client whose put made it ("" after a restart: not journaled).

    A msgspec Struct (constructed in C) without a GC header: 16 B per object
    less than a ``__slots__`` class, and never scanned by the collector (it
    holds no reference cycle: segments do not point back at objects).
    ``eq=False``: compared and hashed by identity, as a plain class."""

    size: int
    replicas: tuple[Any, ...]
    flags: int
    checksum: Any
    writer: str = ""
    lease: float = 0.0
    # last-use stamp: orders objects across shards for LRU
    tick: int = msgspec.field(default_factory=TICKS.__next__)


class Pending(msgspec.Struct, gc=False, eq=False):
    """An in-flight put (PROCESSING replicas). ``pin``: the soft pin its commit
    sets: > 0 a new pin of that many seconds, 0 keep the replaced object's
    (PRESERVE; nothing for a new key), -1 none (DISABLE). A Struct as Obj."""

    size: int
    replicas: tuple[Any, ...]
    flags: int
    checksum: Any
    client_id: str
    started: float
    pin: float = 0.0
    group: str | None = None  # None: unset (an upsert keeps the object's group)


def _item_tick(item: tuple[str, Obj]) -> int:
    return item[1].tick


class ObjectTable:
    """``key -> Obj`` as ``2**bits`` insertion-ordered dict shards, and the
    state that goes with the objects (see the module docstring).

    Dict-like (``get``, ``in``, ``[]``, ``del``, ``len``, iteration, ``items``)
    for the cold paths; hot paths index ``shards[hash(key) & mask]`` inline,
    after :meth:`force` of their batch's keys while a restored snapshot is
    not wholly loaded (``unloaded``, :mod:`kvpool.master.unloaded`).
    Iteration order is shard by shard. Do not mutate while iterating.
    """

    def __init__(self, segtab: SegmentTable, changes: Changes, tenants: TenantTable,
                 bits: int = 8) -> None:
        #: usage per tenant (kvpool.master.tenants): told of every object
        #: stored, forgotten or changed here
        self.tenants = tenants
        self.shards: list[dict[str, Obj]] = [{} for _ in range(1 << bits)]
        self.mask = (1 << bits) - 1
        self.segtab = segtab
        self.changes = changes
        self.pending: dict[str, Pending] = {}
        #: soft-pinned keys -> when their pin ends (clock())
        self.soft_until: dict[str, float] = {}
        self.group_of: dict[str, str] = {}
        self.groups: dict[str, set[str]] = {}
        self._writers: dict[str, str] = {}  # one str per writer id (Obj.writer)
        # KV-cache objects mostly share a few sizes: one int object per size
        # instead of one per object saves 28-32 B/object
        self._sizes: dict[int, int] = {}
        self.lease_s = segtab.cfg.lease_ttl_ms / 1000.0  # a read lease
        #: until then (clock()) every object counts as read-leased: set when an
        #: HA standby is promoted, since the old term's leases were not replicated
        self.lease_grace_until = 0.0
        #: dropped segments whose objects still name them: (segment, keys left)
        self._purge: deque[tuple[Segment, list[str]]] = deque()
        #: a restored snapshot's objects not made yet (None: all are in the shards)
        self.unloaded: Unloaded | None = None

    # ---------------------------------------------------------------- loading
    def force(self, keys: Iterable[str]) -> None:
        """Make the restored objects of ``keys``' load buckets (while
        :attr:`unloaded`): what a batch op calls before it indexes the
        shards inline."""
        u = self.unloaded
        if u is None:
            return
        pending, bmask = u.pending, u.bmask
        for key in keys:
            b = hash(key) & bmask
            if pending[b] is not None:
                self._load(b)
                if self.unloaded is None:
                    return

    def force_all(self) -> None:
        """Make every restored object not made yet (before a pass over the
        whole table)."""
        u = self.unloaded
        if u is None:
            return
        n = u.count
        t0 = time.monotonic()
        for b in range(u.bmask + 1):
            if u.pending[b] is not None:
                self._load(b)
        if n:
            log.info("made the last %d restored objects at once in %.2fs", n,
                     time.monotonic() - t0)

    def load_step(self, budget_s: float) -> bool:
        """Make restored objects for about ``budget_s`` (one load bucket at
        least); return whether any are left (the serving loop's background
        load)."""
        u = self.unloaded
        if u is None:
            return False
        end = time.perf_counter() + budget_s
        while True:
            b = u.next_bucket()
            if b is None:  # (none left: the last take cleared unloaded)
                self.unloaded = None
                return False
            self._load(b)
            if self.unloaded is None:
                return False
            if time.perf_counter() >= end:
                return True

    def _load(self, b: int) -> list[tuple[list[str], list[Obj]]]:
        """Make load bucket ``b``'s restored objects into its shard
        (:mod:`kvpool.master.unloaded`); return them, per table."""
        u = self.unloaded
        assert u is not None
        shard = self.shards[b & self.mask]
        parts: list[tuple[list[str], list[Obj]]] = []
        expected = len(shard)
        for keys, objs, per_seg in u.take(b):
            parts.append((keys, objs))
            shard.update(zip(keys, objs, strict=True))
            expected += len(keys)
            if per_seg is not None:
                for seg, seg_keys in per_seg:
                    seg.keys.update(seg_keys)
            else:
                for key, obj in zip(keys, objs, strict=True):
                    reps = obj.replicas
                    for j in range(0, len(reps), 2):
                        reps[j].keys.add(key)
        if len(shard) != expected:
            self._came_twice(shard, parts)
        if not u.buckets_left:
            self.unloaded = None
            release_heap()  # the decoded columns' pages
            log.info("restored objects all made")
        return parts

    @staticmethod
    def _came_twice(shard: dict[str, Obj], parts: list[tuple[list[str], list[Obj]]]) -> None:
        """A key came twice in the snapshot: the later object is kept (as a
        replay would); the space and segment listing of what only the
        earlier had go (the allocators were rebuilt with both)."""
        for keys, objs in parts:
            for key, obj in zip(keys, objs, strict=True):
                kept = shard[key]
                if kept is obj:
                    continue
                reps, now = obj.replicas, kept.replicas
                for j in range(0, len(reps), 2):
                    seg, off = reps[j], reps[j + 1]
                    if any(now[k] is seg and now[k + 1] == off for k in range(0, len(now), 2)):
                        continue
                    try:
                        seg.alloc.release(off, obj.size)
                    except KVPoolError:  # (a restore rebuilding the allocators from the table)
                        pass
                    if seg not in now[::2]:
                        seg.keys.discard(key)
                log.warning("restore: key %r came twice in the snapshot; the later kept", key)

    # ---------------------------------------------------------------- the map
    def shard(self, key: str) -> dict[str, Obj]:
        u = self.unloaded
        if u is not None:
            b = hash(key) & u.bmask
            if u.pending[b] is not None:
                self._load(b)
        return self.shards[hash(key) & self.mask]

    def shard_at(self, i: int) -> dict[str, Obj]:
        """Shard ``i``, every restored object of it made."""
        u = self.unloaded
        if u is not None:
            for b in u.buckets_of_shard(i):
                if self.unloaded is not None and u.pending[b] is not None:
                    self._load(b)
        return self.shards[i]

    def get(self, key: str) -> Obj | None:
        if self.unloaded is not None:
            return self.shard(key).get(key)
        return self.shards[hash(key) & self.mask].get(key)

    def __contains__(self, key: object) -> bool:
        if self.unloaded is not None:
            return key in self.shard(cast(str, key))
        return key in self.shards[hash(key) & self.mask]

    def __getitem__(self, key: str) -> Obj:
        return self.shard(key)[key]

    def __setitem__(self, key: str, obj: Obj) -> None:
        obj.tick = next(TICKS)  # it goes to the end of its shard: keep the shard in use order
        self.shard(key)[key] = obj

    def __delitem__(self, key: str) -> None:
        del self.shard(key)[key]

    def __len__(self) -> int:
        n = sum(map(len, self.shards))
        return n if self.unloaded is None else n + self.unloaded.count

    def __iter__(self) -> Iterator[str]:
        self.force_all()
        for shard in self.shards:
            yield from shard

    def items(self) -> Iterator[tuple[str, Obj]]:
        self.force_all()
        for shard in self.shards:
            yield from shard.items()

    def lru_items(self) -> Iterator[tuple[str, Obj]]:
        """Least recently used first: a lazy k-way merge of the shards (each in
        use order) by their objects' ``tick`` (O(log shards) per item). While
        restored objects are not all made, the load buckets not made yet
        come first, each made when reached (their objects, never used since
        the restart, are the least recent; a bucket made after its shard's
        first use since the restart follows that use in the shard's order, a
        small departure from LRU that lasts until its objects are used). The
        merge of the shards starts once every bucket is made."""
        u = self.unloaded
        if u is None:
            return heapq.merge(*(shard.items() for shard in self.shards if shard),
                               key=_item_tick)
        return self._lru_loading(u)

    def _lru_loading(self, u: Unloaded) -> Iterator[tuple[str, Obj]]:
        shards = [shard for shard in self.shards if shard]
        made: set[str] = set()  # the objects made here (yielded once, before the rest)
        for b in range(u.bmask + 1):
            if self.unloaded is None:
                break
            if u.pending[b] is not None:
                for keys, objs in self._load(b):
                    made.update(keys)
                    yield from zip(keys, objs, strict=True)
        for key, obj in heapq.merge(*(shard.items() for shard in shards), key=_item_tick):
            if key not in made:
                yield key, obj

    def key_chunks(self) -> Iterator[list[str]]:
        """The keys, one shard per chunk, each copied when it is reached (for a
        fuzzy snapshot: no single O(n) copy)."""
        self.force_all()
        for shard in self.shards:
            if shard:
                yield list(shard)

    # ---------------------------------------------------------------- interning
    def intern_size(self, size: int) -> int:
        """``size`` as the int object shared by every object of that size."""
        sizes = self._sizes
        got = sizes.get(size)
        if got is not None:
            return got
        if len(sizes) < 65536:
            sizes[size] = size
        return size

    def writer(self, client_id: str) -> str:
        """``client_id`` as one shared str per writer (Obj.writer)."""
        writers = self._writers
        got = writers.get(client_id)
        if got is None:
            if len(writers) >= 65536:
                writers.clear()
            got = writers[client_id] = client_id
        return got

    # ---------------------------------------------------------------- groups
    def join_group(self, key: str, group: str) -> None:
        self.group_of[key] = group
        self.groups.setdefault(group, set()).add(key)

    def leave_group(self, key: str) -> None:
        group = self.group_of.pop(key, None)
        if group is not None:
            members = self.groups[group]
            members.discard(key)
            if not members:
                del self.groups[group]

    def lease_group(self, key: str, obj: Obj, lease: float, now: float) -> None:
        """A read of grouped ``key`` at ``now``: lease every member of its
        group until ``lease`` (only when this object's lease was past its
        first half: repeated reads cost one lookup)."""
        if obj.lease - self.lease_s / 2 > now:
            return
        get = self.get
        for member in self.groups[self.group_of[key]]:
            other = get(member)
            if other is not None and other.lease < lease:
                other.lease = lease

    # ---------------------------------------------------------------- change
    def complete(self, key: str, size: int, reps: tuple[Any, ...], flags: int,
                 checksum: Any, writer: str = "") -> Obj:
        """Store a COMPLETE object (replacing none: the caller retired any) and
        record it."""
        obj = Obj(size, reps, flags, checksum, writer)
        shard = self.shards[hash(key) & self.mask] if self.unloaded is None else self.shard(key)
        shard[key] = obj
        tenants = self.tenants
        if key < " " or tenants.track_default:
            tenants.stored(key, obj)
        changes = self.changes
        if not changes.journaling:  # replay, a standby: no record to build
            for i in range(0, len(reps), 2):
                reps[i].keys.add(key)
            return obj
        changes.records.append(self.put_record(key, obj))
        for i in range(0, len(reps), 2):
            reps[i].keys.add(key)
        return obj

    @staticmethod
    def put_record(key: str, obj: Obj) -> Put:
        """The record of ``obj``'s whole live replica set (replay: a PUT replaces)."""
        wire: list[Any] = []
        reps = obj.replicas
        for i in range(0, len(reps), 2):
            if reps[i].state != _DEAD:
                wire += (reps[i].id, reps[i + 1])
        return Put(key, obj.size, obj.flags, obj.checksum, wire)

    def forget(self, key: str, obj: Obj) -> None:
        """Take ``obj`` out of the table, its pin and its group (its replicas'
        space is the caller's)."""
        del self.shards[hash(key) & self.mask][key]
        tenants = self.tenants
        if key < " " or tenants.track_default:
            tenants.forgotten(key, obj)
        if obj.flags & SOFT_PIN:
            self.soft_until.pop(key, None)
        if self.group_of:
            self.leave_group(key)

    def remove(self, key: str, obj: Obj,
               free: Callable[[tuple[Any, ...], int], None] | None = None) -> None:
        """Remove ``obj`` and free its replicas now (recorded); ``free``
        (replicas, size): how to free them instead (held until a time)."""
        self.forget(key, obj)
        reps = obj.replicas
        for i in range(0, len(reps), 2):
            reps[i].keys.discard(key)
        (free or self.segtab.free)(reps, obj.size)
        changes = self.changes
        if changes.journaling:
            changes.records.append(Remove(key))

    # ---------------------------------------------------------------- dropped segments
    def purge_later(self, seg: Segment, keys: list[str]) -> None:
        """``seg`` was dropped with replicas of ``keys``: take them out in slices."""
        if keys:
            self._purge.append((seg, keys))

    @property
    def purge_pending(self) -> bool:
        return bool(self._purge)

    def purge_step(self, budget: int) -> int:
        """Remove up to ``budget`` replicas of dropped segments (an object that
        loses its last goes, unrecorded: the segment's drop was); return the
        work left."""
        while budget > 0 and self._purge:
            seg, keys = self._purge[0]
            n = min(budget, len(keys))
            for _ in range(n):
                key = keys.pop()
                obj = self.get(key)
                if obj is None:
                    continue
                reps = obj.replicas
                if seg not in reps[::2]:
                    continue
                kept: list[Any] = []
                for i in range(0, len(reps), 2):
                    if reps[i] is not seg:
                        kept += (reps[i], reps[i + 1])
                if kept:
                    tenants = self.tenants
                    if key < " " or tenants.track_default:
                        tenants.rereps(key, obj.size, reps, tuple(kept))
                    obj.replicas = tuple(kept)
                else:
                    self.forget(key, obj)
            budget -= n
            if not keys:
                self._purge.popleft()
        return sum(len(k) for _, k in self._purge)

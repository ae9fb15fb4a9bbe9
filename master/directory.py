"""The master's state: segments, the replica directory, leases, eviction, liveness.

Pure logic, no I/O: the server feeds it requests and ships the journal
records it emits (``records``) to the journal before replying.

Memory layout (the 1M-object target is <= 400 B/object): an object is a
msgspec Struct without a GC header whose ``replicas`` is one flat tuple
``(segment, offset, segment, offset, ...)`` (every replica has the object's
length); ``objects`` is an :class:`ObjectTable`: 256 insertion-ordered dict
shards, each an LRU list (a read moves the key to the end of its shard and
stamps it with a global use tick; eviction merges the shard fronts by tick:
global LRU order). Shards
let a snapshot copy keys one shard at a time instead of 1M keys at once. Segments keep the
set of keys that have a replica on them so dropping a segment touches only
its own objects, in bounded slices.

Liveness (busy is not dead): a client that has not called for
``client_ttl_s`` becomes *suspect*: its segments take no new placements but
keep their objects, and it is ACTIVE again with all of them at its next ping.
Its objects go only when its memory is really gone: an unmount (its close(),
or its guard process / a same-host janitor that saw it die), or silence of
the client *and* its guard for ``client_ttl_s + client_grace_s``. The guard
(``kvpool.store.guard``) heartbeats for a stalled process (GIL held,
SIGSTOP), so a live process's segments are never dropped; a frozen host or
cgroup (guard frozen too) is covered by the grace.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import operator
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from enum import IntEnum
from typing import Any

import msgspec

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import KEY_MIN, SegmentDescriptor, SegmentKind
from kvpool.master.allocator import Allocator
from kvpool.master.config import MasterConfig

__all__ = [
    "HARD_PIN",
    "SOFT_PIN",
    "Directory",
    "EvictionPolicy",
    "Obj",
    "ObjectTable",
    "Pending",
    "Rec",
    "SegState",
    "Segment",
    "write_grant_ms",
]

log = logging.getLogger(__name__)

HARD_PIN = 1
SOFT_PIN = 2
# Beyond a WRITE capability's expiry, how long a transfer server may still
# accept it (its capability_leeway_ms, 2 s by default, plus clock skew).
_WRITE_LEEWAY_S = 5.0

OK = ErrorCode.OK
_MEM = SegmentKind.MEMORY
_FILE = SegmentKind.FILE
_FREE = operator.attrgetter("alloc.free")


class Rec(IntEnum):
    """Journal record tags (first element of each record list)."""

    MOUNT = 1  # [1, segment descriptor wire]
    DROP_SEGMENT = 2  # [2, segment_id]  (unmount, expiry, owner never returned)
    PUT = 3  # [3, key, size, flags, checksum, [segment_id, offset, ...]]
    REMOVE = 4  # [4, key]  (remove, eviction of the last replica)
    DROP_REPLICA = 5  # [5, key, segment_id]  (eviction of one tier's replica)


class SegState(IntEnum):
    ACTIVE = 0
    AWAITING = 1  # restored after a restart, owner has not come back yet
    DEAD = 2  # dropped; replicas referencing it are being purged
    # its owner missed its pings (busy, stopped, partitioned or dead): no new
    # placements; its replicas are still returned when no ACTIVE one exists;
    # ACTIVE again with every object when the owner pings or re-mounts it
    SUSPECT = 3


_DEAD = SegState.DEAD
_ACTIVE = SegState.ACTIVE
_SUSPECT = SegState.SUSPECT
_REC_PUT = int(Rec.PUT)
_INVALID_KEY = int(ErrorCode.INVALID_KEY)


class Segment:
    """A mounted segment and its allocator."""

    __slots__ = ("alloc", "desc", "id", "keys", "kind", "owner", "state", "wire")

    def __init__(self, desc: SegmentDescriptor, alignment: int, state: SegState) -> None:
        self.id = desc.segment_id
        self.desc = desc
        self.kind = desc.kind
        self.owner = desc.client_id
        # ``size`` is the usable size (the region starts at base_offset), as
        # the transfer layer's segments describe themselves
        self.alloc = Allocator(max(desc.size, 0), alignment)
        self.keys: set[str] = set()
        self.state = state
        self.wire = desc.to_wire()

    def __repr__(self) -> str:
        return f"Segment({self.id!r}, {self.kind.name}, {self.state.name})"


# Monotonic use counter shared by every object: each shard is in use order,
# so merging the shards by tick yields exact global LRU order.
_TICKS = itertools.count(1)


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
    tick: int = msgspec.field(default_factory=_TICKS.__next__)


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
    """``key -> Obj`` as ``2**bits`` insertion-ordered dict shards.

    Dict-like (``get``, ``in``, ``[]``, ``del``, ``len``, iteration, ``items``)
    for the cold paths; hot paths index ``shards[hash(key) & mask]`` inline.
    Iteration order is shard by shard. Do not mutate while iterating.
    """

    __slots__ = ("mask", "shards")

    def __init__(self, bits: int = 8) -> None:
        self.shards: list[dict[str, Obj]] = [{} for _ in range(1 << bits)]
        self.mask = (1 << bits) - 1

    def shard(self, key: str) -> dict[str, Obj]:
        return self.shards[hash(key) & self.mask]

    def get(self, key: str) -> Obj | None:
        return self.shards[hash(key) & self.mask].get(key)

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) & self.mask]

    def __getitem__(self, key: str) -> Obj:
        return self.shards[hash(key) & self.mask][key]

    def __setitem__(self, key: str, obj: Obj) -> None:
        obj.tick = next(_TICKS)  # it goes to the end of its shard: keep the shard in use order
        self.shards[hash(key) & self.mask][key] = obj

    def __delitem__(self, key: str) -> None:
        del self.shards[hash(key) & self.mask][key]

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __iter__(self) -> Iterator[str]:
        for shard in self.shards:
            yield from shard

    def items(self) -> Iterator[tuple[str, Obj]]:
        for shard in self.shards:
            yield from shard.items()

    def lru_items(self) -> Iterator[tuple[str, Obj]]:
        """Least recently used first: a lazy k-way merge of the shards (each in
        use order) by their objects' ``tick`` (O(log shards) per item)."""
        return heapq.merge(*(shard.items() for shard in self.shards if shard),
                           key=_item_tick)

    def key_chunks(self) -> Iterator[list[str]]:
        """The keys, one shard per chunk, each copied when it is reached (for a
        fuzzy snapshot: no single O(n) copy)."""
        for shard in self.shards:
            if shard:
                yield list(shard)


class EvictionPolicy:
    """Policy point for eviction (the SSD tier, kvpool.master.tiering, hooks in here).

    ``on_evict(directory, key, obj, kind)`` is called for each victim before
    its replicas in pool ``kind`` are freed. Return True when the policy
    handled the object itself (e.g. it gave the object a FILE replica and
    will free the memory replica once the copy is done); the directory then
    leaves it alone. The default frees the replicas (returns False).
    """

    def on_evict(self, directory: Directory, key: str, obj: Obj, kind: SegmentKind) -> bool:
        return False

    # SSD-tier hooks (kvpool.master.tiering); the defaults change nothing
    def on_owner_lost(self, directory: Directory, seg: Segment) -> bool:
        """A client expired: True = the policy kept ``seg`` (not dropped)."""
        return False

    def can_take_over(self, directory: Directory, seg: Segment,
                      desc: SegmentDescriptor) -> bool:
        """A mount names the ACTIVE segment ``seg``: True = re-adopt it for the caller."""
        return False

    def after_restore(self, directory: Directory) -> None:
        """Called at the end of ``finish_restore``."""

    def spill_on_full(self, directory: Directory) -> bool:
        """A put that memory cannot take even after eviction: True = place its
        replicas on FILE segments instead (the default: fail the put)."""
        return False


def write_grant_ms(cfg: MasterConfig) -> int:
    """How long the WRITE capability granted with a put's replicas is valid:
    a big put over a slow link must not be cut off mid-way."""
    return max(cfg.capability_ttl_ms or cfg.lease_ttl_ms,
               int(cfg.put_start_discard_timeout_s * 1000))


class Directory:
    """Segments + objects + clients. Methods return ``(code, value)`` for
    per-key ops (cheap in batches) and raise KVPoolError for whole-request
    errors. Every state change a client is told about appends a record to
    ``records`` (the server journals them before replying)."""

    def __init__(
        self,
        cfg: MasterConfig,
        clock: Callable[[], float] = time.monotonic,
        policy: EvictionPolicy | None = None,
        shard_bits: int = 8,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.policy = policy or EvictionPolicy()
        self.segments: dict[str, Segment] = {}
        self.pools: dict[SegmentKind, list[Segment]] = {_MEM: [], _FILE: []}
        self.pool_used: dict[SegmentKind, int] = {_MEM: 0, _FILE: 0}
        self.pool_cap: dict[SegmentKind, int] = {_MEM: 0, _FILE: 0}
        # client id -> last time the client process itself called (ping or any op)
        self.clients: dict[str, float] = {}
        # client id -> last heartbeat of its guard process (its memory is alive)
        self.heartbeats: dict[str, float] = {}
        # client id -> since when it is suspect (silent for client_ttl)
        self.suspects: dict[str, float] = {}
        self.client_segments: dict[str, set[str]] = {}
        # after a restart: owner client id -> ids of its segments awaiting it
        self.awaiting: dict[str, set[str]] = {}
        self.awaiting_deadline = 0.0
        self.restored_at = 0.0
        self.objects = ObjectTable(shard_bits)  # shard_bits=0: one shard, exact LRU
        self.pending: dict[str, Pending] = {}
        self.records: list[list[Any]] = []
        self.journaling = True
        self._purge: deque[tuple[Segment, list[str]]] = deque()
        self.lease_s = cfg.lease_ttl_ms / 1000.0
        # until then (clock()) every object counts as read-leased: set when an
        # HA standby is promoted, since the old term's leases were not replicated
        self.lease_grace_until = 0.0
        self.evictions = 0
        self.evicting: set[SegmentKind] = set()  # pools whose eviction continues
        self.evicted_bytes = 0
        self.lease_refusals = 0
        self.preemptions = 0
        self.expired_clients = 0  # dropped: silent past client_ttl + grace, or no segments
        self.suspected_clients = 0  # times a client became suspect
        self.revived_clients = 0  # times a suspect client came back with its segments
        self.spilled = 0  # puts placed on disk because memory was full
        # space of abandoned puts, held while their writer may still write:
        # heap of (release time, seq, replicas, size)
        self._held: list[tuple[float, int, tuple[Any, ...], int]] = []
        self._held_seq = itertools.count()
        self.write_window_s = write_grant_ms(cfg) / 1000.0 + _WRITE_LEEWAY_S
        self._rng = random.Random()
        # soft-pinned keys -> when their pin ends (clock()); not journaled: a
        # restored soft-pinned object is ordinary cache (as Mooncake's)
        self.soft_until: dict[str, float] = {}
        self.soft_pin_s = cfg.soft_pin_ttl_ms / 1000.0
        self.replaced = 0  # objects replaced by an upsert
        # object groups (Mooncake's ReplicateConfig.group_ids): a read of a member
        # leases every member; eviction takes a group's evictable members
        # together. In memory only: after a restart objects are ungrouped.
        self.group_of: dict[str, str] = {}
        self.groups: dict[str, set[str]] = {}
        self._writers: dict[str, str] = {}  # one str per writer id (Obj.writer)
        # KV-cache objects mostly share a few sizes: one int object per size
        # instead of one per object saves 28-32 B/object
        self._sizes: dict[int, int] = {}

    def _intern_size(self, size: int) -> int:
        sizes = self._sizes
        got = sizes.get(size)
        if got is not None:
            return got
        if len(sizes) < 65536:
            sizes[size] = size
        return size

    # ---------------------------------------------------------------- segments
    def _alignment(self, kind: SegmentKind) -> int:
        return self.cfg.file_alignment if kind == _FILE else self.cfg.memory_alignment

    def _activate(self, seg: Segment) -> None:
        seg.state = SegState.ACTIVE
        self.pools[seg.kind].append(seg)
        self.pool_used[seg.kind] += seg.alloc.used
        self.pool_cap[seg.kind] += seg.alloc.capacity
        self.client_segments.setdefault(seg.owner, set()).add(seg.id)

    def _unpool(self, seg: Segment) -> None:
        """Take an ACTIVE segment out of its pool (no new placements)."""
        if seg.state == _ACTIVE:
            self.pools[seg.kind].remove(seg)
            self.pool_used[seg.kind] -= seg.alloc.used
            self.pool_cap[seg.kind] -= seg.alloc.capacity

    @staticmethod
    def _unlist(index: dict[str, set[str]], seg: Segment) -> None:
        """Take ``seg`` out of its owner's set in ``index`` (dropping an emptied set)."""
        ids = index.get(seg.owner)
        if ids is not None:
            ids.discard(seg.id)
            if not ids:
                del index[seg.owner]

    def _deactivate(self, seg: Segment) -> None:
        self._unpool(seg)
        self._unlist(self.client_segments, seg)

    def _suspend(self, seg: Segment) -> None:
        """ACTIVE -> SUSPECT: out of the pools (no new placements), objects kept."""
        self._unpool(seg)
        seg.state = _SUSPECT

    def mount(self, client_id: str, desc: SegmentDescriptor) -> None:
        """Mount a segment, or re-adopt the one registered under its id.

        Re-adoption keeps every object: a segment AWAITING its owner after a
        restart, or SUSPECT, comes back when the mount names the same region
        (kind, size, base offset and, for memory, the same shm name: the same
        memory). A memory segment that comes back under its id with another
        shm name is new memory: the old one's objects are dropped first.
        """
        if desc.size <= 0 or desc.base_offset < 0:
            raise KVPoolError("segment size must be > 0 and base_offset >= 0",
                              ErrorCode.INVALID_PARAMS)
        if not desc.segment_id:
            raise KVPoolError("empty segment_id", ErrorCode.INVALID_PARAMS)
        self.clients[client_id] = self.clock()
        seg = self.segments.get(desc.segment_id)
        if seg is not None:
            state = seg.state
            if state != SegState.AWAITING and seg.owner != client_id \
                    and self.policy.can_take_over(self, seg, desc):
                log.info("segment %s reopened by %s: taking over from %s", seg.id, client_id,
                         seg.owner)
            elif state == _ACTIVE:
                raise KVPoolError(f"segment {desc.segment_id} is mounted",
                                  ErrorCode.SEGMENT_ALREADY_EXISTS)
            if (seg.kind != desc.kind or seg.desc.size != desc.size
                    or seg.desc.base_offset != desc.base_offset):
                raise KVPoolError(f"segment {desc.segment_id} differs from the restored one",
                                  ErrorCode.SEGMENT_MISMATCH)
            if seg.kind == _MEM and seg.desc.name != desc.name:
                # same id, other shared memory: the old region's bytes are not in it
                self.drop_segment(seg, f"re-mounted by {client_id} with new memory {desc.name}")
                seg = None
        if seg is not None:
            # re-adopt: same region, possibly a new owner id / endpoint
            self._forget_awaiting(seg)
            self._deactivate(seg)
            desc.client_id = client_id
            seg.desc, seg.owner, seg.wire = desc, client_id, desc.to_wire()
            self._activate(seg)
            log.info("re-adopted segment %s (%d objects) for %s", seg.id, len(seg.keys), client_id)
        else:
            desc.client_id = client_id
            seg = Segment(desc, self._alignment(desc.kind), SegState.ACTIVE)
            self.segments[seg.id] = seg
            self._activate(seg)
            log.info("mounted %s segment %s (%d B) for %s", desc.kind.name, seg.id, desc.size,
                     client_id)
        if self.journaling:
            self.records.append([Rec.MOUNT, seg.wire])

    def unmount(self, client_id: str, segment_id: str) -> None:
        seg = self.segments.get(segment_id)
        if seg is None:
            raise KVPoolError(f"no segment {segment_id}", ErrorCode.SEGMENT_NOT_FOUND)
        if seg.owner != client_id:
            raise KVPoolError(f"segment {segment_id} belongs to another client",
                              ErrorCode.PERMISSION_DENIED)
        self.clients[client_id] = self.clock()
        self.drop_segment(seg, "unmounted")

    def drop_segment(self, seg: Segment, why: str) -> None:
        """Remove a segment now; its objects' replicas are purged in slices
        (``purge_step``); lookups already ignore it."""
        if seg.state == SegState.AWAITING:
            self._forget_awaiting(seg)
        self._deactivate(seg)
        seg.state = SegState.DEAD
        del self.segments[seg.id]
        if seg.keys:
            self._purge.append((seg, list(seg.keys)))
        seg.keys = set()
        log.info("dropped segment %s (%s)", seg.id, why)
        if self.journaling:
            self.records.append([Rec.DROP_SEGMENT, seg.id])

    def _forget_awaiting(self, seg: Segment) -> None:
        self._unlist(self.awaiting, seg)

    def purge_step(self, budget: int) -> int:
        """Remove up to ``budget`` replicas of dropped segments; return the work left."""
        objects = self.objects
        while budget > 0 and self._purge:
            seg, keys = self._purge[0]
            n = min(budget, len(keys))
            for _ in range(n):
                key = keys.pop()
                obj = objects.get(key)
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
                    obj.replicas = tuple(kept)
                else:
                    del objects[key]
                    if obj.flags & SOFT_PIN:
                        self.soft_until.pop(key, None)
                    if self.group_of:
                        self._leave_group(key)
            budget -= n
            if not keys:
                self._purge.popleft()
        return sum(len(k) for _, k in self._purge)

    @property
    def purge_pending(self) -> bool:
        return bool(self._purge)

    # ---------------------------------------------------------------- clients
    def touch(self, client_id: str) -> None:
        self.clients[client_id] = self.clock()

    def ping(self, client_id: str) -> tuple[bool, list[str]]:
        """The client process itself is alive and running: record it, make its
        suspect segments ACTIVE again (with their objects) and revive its
        segments awaiting it after a restart. Return (remount, segment_ids)."""
        known = client_id in self.clients
        self.clients[client_id] = self.clock()
        if client_id in self.suspects:
            self._revive(client_id)
        for sid in sorted(self.awaiting.pop(client_id, ())):
            seg = self.segments[sid]
            self._activate(seg)
            log.info("owner %s is back: segment %s active again", client_id, seg.id)
        ids = sorted(self.client_segments.get(client_id, ()))
        return (not known and not ids), ids

    def heartbeat(self, client_id: str) -> bool:
        """A heartbeat from the client's guard process: the client's memory
        still exists, whether or not the process itself is running. Keeps a
        suspect client from being dropped; never makes it ACTIVE (only the
        client's own ping does). After a restart, segments awaiting this owner
        become SUSPECT (kept while the guard beats). Return whether the client
        is known (False: nothing is kept for it)."""
        now = self.clock()
        if client_id in self.clients:
            self.heartbeats[client_id] = now
            return True
        waiting = self.awaiting.pop(client_id, None)
        if not waiting:
            return False
        self.heartbeats[client_id] = now
        self.clients[client_id] = self.restored_at  # not heard from since the restart
        self.suspects[client_id] = now
        self.suspected_clients += 1
        for sid in sorted(waiting):
            seg = self.segments[sid]
            seg.state = _SUSPECT
            self.client_segments.setdefault(seg.owner, set()).add(seg.id)
        log.warning("client %s: only its guard answers since the restart; %d segment(s) "
                    "suspect", client_id, len(waiting))
        return True

    def _revive(self, client_id: str) -> None:
        since = self.suspects.pop(client_id)
        n = 0
        for sid in sorted(self.client_segments.get(client_id, ())):
            seg = self.segments[sid]
            if seg.state == _SUSPECT:
                self._activate(seg)
                n += 1
        self.revived_clients += 1
        log.warning("client %s is back after %.1fs: %d segment(s) active again with their "
                    "objects", client_id, self.clock() - since, n)

    def _forget_client(self, client_id: str) -> None:
        self.clients.pop(client_id, None)
        self.heartbeats.pop(client_id, None)
        self.suspects.pop(client_id, None)
        self.expired_clients += 1

    def expire_step(self) -> int:
        """Liveness timer; at most ``expiry_slice`` segments change per call.

        - A client silent for ``client_ttl_s`` becomes suspect: its segments
          leave the pools (no new placements) and keep their objects. One
          that owns no segment (a pure client; one whose guard unmounted its
          memory) is dropped then: its in-flight puts are revoked.
        - A suspect client silent, and its guard silent, for
          ``client_ttl_s + client_grace_s`` is dropped with its segments
          (a FILE segment may be kept by the tier policy).
        - Restored segments whose owner has not come back by
          ``awaiting_deadline`` are dropped likewise.

        Return how many segments were dropped."""
        now = self.clock()
        ttl = self.cfg.client_ttl_s
        limit = ttl + self.cfg.client_grace_s
        budget = self.cfg.expiry_slice
        work = 0
        dropped = 0
        segments = self.segments
        for client_id in [c for c, t in self.clients.items() if now - t > ttl]:
            owned = self.client_segments.get(client_id)
            if not owned:  # nothing to keep for it (e.g. a pure client)
                self._forget_client(client_id)
                log.info("client %s expired", client_id)
                continue
            if client_id not in self.suspects:
                self.suspects[client_id] = now
                self.suspected_clients += 1
                log.warning("client %s silent for %.1fs: %d segment(s) suspect (kept; no new "
                            "placements)", client_id, now - self.clients[client_id],
                            len(owned))
            for sid in sorted(owned or ()):
                seg = segments[sid]
                if seg.state == _ACTIVE:
                    if work >= budget:
                        return dropped
                    self._suspend(seg)
                    work += 1
        for client_id in list(self.suspects):
            last = max(self.clients.get(client_id, 0.0), self.heartbeats.get(client_id, 0.0))
            if now - last <= limit:
                continue
            owned = self.client_segments.get(client_id)
            for sid in sorted(owned or ())[:budget - work]:
                seg = segments[sid]
                if not self.policy.on_owner_lost(self, seg):  # SSD tier keeps files
                    self.drop_segment(seg, f"client {client_id} silent for {now - last:.1f}s")
                dropped += 1
                work += 1
            if self.client_segments.get(client_id):
                return dropped  # budget spent; the rest next time
            self._forget_client(client_id)
            log.warning("client %s dropped: no ping or heartbeat for %.1fs", client_id,
                        now - last)
        if self.awaiting and now > self.awaiting_deadline:
            for owner in list(self.awaiting):
                for sid in list(self.awaiting.get(owner, ())):
                    if work >= budget:
                        return dropped
                    seg = segments[sid]
                    if not self.policy.on_owner_lost(self, seg):  # SSD tier keeps files
                        self.drop_segment(seg, "owner did not return after restart")
                    dropped += 1
                    work += 1
        return dropped

    def sweep_pending(self) -> int:
        """Revoke in-flight puts older than put_start_release_timeout (a
        reservation: than its write window) or whose client was dropped (a
        suspect client's puts stay); free the held space of
        abandoned puts whose write window passed. Return how many puts were revoked."""
        now = self.clock()
        held = self._held
        while held and held[0][0] <= now:
            _, _, reps, size = heapq.heappop(held)
            self._free_replicas(reps, size)
        limit = self.cfg.put_start_release_timeout_s
        # a reservation (placeholder key) is of no use once its WRITE grant ended:
        # one whose holder never learnt of it (its reply lost) goes then
        resv = min(limit, self.write_window_s)
        stale = [k for k, p in self.pending.items()
                 if now - p.started > (resv if k < KEY_MIN else limit)
                 or p.client_id not in self.clients]
        for k in stale:
            self._release_pending(k, self.pending.pop(k))
        return len(stale)

    # ---------------------------------------------------------------- puts
    def _free_replicas(self, reps: tuple[Any, ...], size: int) -> None:
        pool_used = self.pool_used
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.state == SegState.DEAD:
                continue
            before = seg.alloc.used
            seg.alloc.release(reps[i + 1], size)
            if seg.state == SegState.ACTIVE:
                pool_used[seg.kind] -= before - seg.alloc.used

    def _release_pending(self, key: str, p: Pending) -> None:
        """Give back an abandoned put's space, once no write into it can land.

        A writer that gave up (its transfer timed out) may still have bytes
        on their way: queued in a stalled peer's socket, or in a copy thread.
        Reusing the space at once let such a late write overwrite the next
        object placed there (seen: a 2-byte object read back as the 'zz' of
        a revoked 100 KB put after its stalled holder resumed). So the space
        stays allocated until the WRITE capability granted with the put has
        expired everywhere (``write_window_s`` after put_start)."""
        until = p.started + self.write_window_s
        self.hold_replicas(p.replicas, p.size, until)

    def _preempt(self, key: str, p: Pending, now: float, force: bool = False) -> bool:
        """Preempt ``p``, the in-flight put of ``key``, when its writer is
        presumed dead (it started over put_start_discard_timeout_s before
        ``now``) or ``force``: its space goes back as :meth:`_release_pending`
        says. False: ``p`` stays in flight."""
        if not force and now - p.started <= self.cfg.put_start_discard_timeout_s:
            return False
        del self.pending[key]
        self._release_pending(key, p)
        self.preemptions += 1
        return True

    def _candidates(self, kind: SegmentKind, n: int, preferred: list[str],
                    exclude: list[Segment]) -> Iterator[Segment]:
        for sid in preferred:
            seg = self.segments.get(sid)
            if seg is not None and seg.kind == kind and seg.state == SegState.ACTIVE \
                    and seg not in exclude:
                exclude.append(seg)
                yield seg
        pool = self.pools[kind]
        if len(pool) > 32:
            # power of choices: sample a few, most free first
            pool = self._rng.sample(pool, min(len(pool), 2 * n + 6))
        for seg in sorted(pool, key=_FREE, reverse=True):
            if seg not in exclude:
                yield seg

    def _place(self, size: int, n: int, kind: SegmentKind, preferred: list[str],
               out: list[Any]) -> int:
        """Allocate up to ``n`` replicas of ``size`` on distinct segments of
        ``kind``; append (segment, offset) to ``out``; return how many."""
        if n <= 0 or not self.pools[kind]:
            return 0
        got = 0
        taken: list[Segment] = []
        attempts = 4
        for attempt in range(attempts):
            excl = list(taken)
            full = 0  # candidates that had no room (the only shortfall eviction can mend)
            for seg in self._candidates(kind, n, preferred if attempt == 0 else [], excl):
                before = seg.alloc.used
                off = seg.alloc.allocate(size)
                if off < 0:
                    full += 1
                    continue
                taken.append(seg)
                excl.append(seg)
                self.pool_used[kind] += seg.alloc.used - before
                out += (seg, off)
                got += 1
                if got == n:
                    break
            if got == n or attempt == attempts - 1 or not full:
                # (every candidate took a replica: fewer segments than replicas,
                # e.g. one of two holders suspect. Evicting cannot add a segment;
                # it would only throw away other objects, put after put)
                break
            # an allocation failed: make room (LRU eviction) and retry the rest;
            # freed space may be scattered, so each retry frees twice as much
            if not self.evict(kind, need=size * (n - got) << attempt):
                break
        cap = self.pool_cap[kind]
        if cap and self.pool_used[kind] > self.cfg.eviction_high_watermark * cap:
            self.evict(kind)
        return got

    def put_start(self, client_id: str, key: str, size: int, replica_num: int = 1,
                  preferred: list[str] | None = None, flags: int = 0, checksum: Any = None,
                  disk_replica_num: int = 0, soft_pin_ms: int = -1, replace: bool = False,
                  unpin: bool = False, group: str | None = None) -> tuple[int, Any]:
        """Allocate replicas for a new object; value is the Pending (or None).

        ``flags`` with SOFT_PIN: pinned for ``soft_pin_ms`` from the commit
        (-1: the configured default; 0: not pinned). ``replace`` (an upsert):
        an existing object stays readable, unchanged, until PUT_END swaps in the
        new one (its hard pin carries over; its soft pin too unless the new put
        pins anew or ``unpin``); an in-flight put of the key is preempted at
        once. Without ``replace`` an existing key is OBJECT_ALREADY_EXISTS.
        ``group``: the object group it joins at the commit ("" none; None
        unset); an existing object's group cannot change (INVALID_PARAMS)."""
        objects = self.objects
        if key in objects.shards[hash(key) & objects.mask]:
            if not replace:
                return ErrorCode.OBJECT_ALREADY_EXISTS, None
            if group is not None and group != self.group_of.get(key, ""):
                return ErrorCode.INVALID_PARAMS, None
        now = self.clock()
        self.clients[client_id] = now
        pin = -1.0 if unpin else 0.0
        if flags & SOFT_PIN:
            ms = self.cfg.soft_pin_ttl_ms if soft_pin_ms < 0 else soft_pin_ms
            if ms > 0:
                pin = ms / 1000.0
            else:  # a zero TTL commits the object as ordinary cache
                flags &= ~SOFT_PIN
                pin = -1.0
        p = self.pending.get(key)
        # an upsert takes the key over from an in-flight put at once
        if p is not None and not self._preempt(key, p, now, replace):
            return ErrorCode.OBJECT_ALREADY_EXISTS, None
        out: list[Any] = []
        if replica_num == 1 and not disk_replica_num and not preferred:
            # fast path (the common case): one memory replica on the most-free segment
            pool = self.pools[_MEM]
            if pool:
                if len(pool) > 32:
                    pool = self._rng.sample(pool, 8)
                seg = max(pool, key=_FREE) if len(pool) > 1 else pool[0]
                alloc = seg.alloc
                before = alloc.used
                off = alloc.allocate(size)
                if off >= 0:
                    used = self.pool_used[_MEM] + alloc.used - before
                    self.pool_used[_MEM] = used
                    out += (seg, off)
                    if used > self.cfg.eviction_high_watermark * self.pool_cap[_MEM]:
                        self.evict(_MEM)
        if not out:
            pref = preferred or []
            got = self._place(size, replica_num, _MEM, pref, out)
            # memory is full and eviction could not free it at once (its victims
            # wait for their copy to disk): the disk tier takes the object now
            spill = replica_num if replica_num and not got \
                and self.policy.spill_on_full(self) else 0
            if disk_replica_num or spill:
                if self._place(size, max(disk_replica_num, spill), _FILE, pref, out) and spill:
                    self.spilled += 1
        if not out:
            return ErrorCode.NO_AVAILABLE_HANDLE, None
        p = Pending(self._intern_size(size), tuple(out), flags, checksum, client_id, now, pin,
                    group)
        self.pending[key] = p
        return OK, p

    def put_start_many(self, client_id: str, keys: list[str], sizes: list[int], max_key: int,
                       max_size: int, codes: list[int], out: list[Any],
                       key_min: str = KEY_MIN) -> None:
        """PUT_START of many keys with the default options (one memory
        replica; no pin, checksum, group or replace), as :meth:`put_start`
        key by key, in one pass: per-key work only. Key ``i`` sets
        ``codes[i]`` (INVALID_KEY for an empty or too long key,
        INVALID_PARAMS for a size outside ``[1, max_size]``, or put_start's
        code) and, when OK, ``out[i]`` = its flat replicas. Anything but a
        new key placed at once on a pool of up to 32 segments (preemption,
        eviction, a full pool) takes :meth:`put_start` itself.``key_min``: the
        lowest key taken (RESERVED_KEY_PREFIX for reservations' placeholders)."""
        objects = self.objects
        shards, mask = objects.shards, objects.mask
        pending = self.pending
        pool = self.pools[_MEM]
        pool_used = self.pool_used
        cap = self.pool_cap[_MEM]
        high = self.cfg.eviction_high_watermark
        sizes_get = self._sizes.get
        intern = self._intern_size
        exists = int(ErrorCode.OBJECT_ALREADY_EXISTS)
        bad_key = int(ErrorCode.INVALID_KEY)
        bad_size = int(ErrorCode.INVALID_PARAMS)
        now = self.clock()
        stamped = False
        # free bytes per pool segment: max() over ints picks the same (first)
        # most-free segment as put_start's max(pool, key=free)
        fast = 0 < len(pool) <= 32
        frees = [seg.alloc.free for seg in pool] if fast else []
        n = len(keys)
        # a pool of one segment: the ranges of a run of equal sizes are carved
        # at once (Allocator.allocate_run: what allocate() would give key by
        # key); the ones left over go back before anything else allocates
        run_seg: Any = None
        run_off = run_left = run_size = run_need = 0
        # a pool of 2..32 segments: a run of equal sizes is planned at once
        # (_plan_run: the segment each key would pick, its ranges carved per
        # segment); plan_at indexes the next key's (segment, offset) in it
        plan: list[tuple[Any, int]] | None = None
        plan_at = 0
        plan_size = plan_need = -1
        plan_ok = True  # a plan that could not be carved: key by key for the rest
        for i in range(n):
            key = keys[i]
            size = sizes[i]
            if key < key_min or len(key) > max_key:
                codes[i] = bad_key
                continue
            if size <= 0 or size > max_size:
                codes[i] = bad_size
                continue
            if key in shards[hash(key) & mask]:
                codes[i] = exists
                continue
            if not stamped:
                self.clients[client_id] = now
                stamped = True
            reps: Any = None  # placed inline: from the run, the plan or the most-free segment
            if len(frees) == 1 and key not in pending:
                if not run_left or size != run_size:
                    if run_left:
                        run_seg.alloc.release(run_off, run_left * run_need)
                    run_seg = pool[0]
                    run_off, run_left = run_seg.alloc.allocate_run(size, n - i)
                    run_size, run_need = size, run_seg.alloc.aligned(size)
                if run_left:
                    reps = (run_seg, run_off)
                    need = run_need
                    run_off += run_need
                    run_left -= 1
            elif plan_ok and len(frees) > 1 and key not in pending:
                if plan is None or plan_at == len(plan) or size != plan_size:
                    if plan is not None:
                        self._unplan(plan, plan_at, plan_size)
                        frees = [seg.alloc.free for seg in pool]
                    m = i + 1
                    while m < n and sizes[m] == size:
                        m += 1
                    plan = self._plan_run(pool, frees, size, m - i) or None
                    plan_at = 0
                    plan_size = size
                    plan_need = pool[0].alloc.aligned(size)
                    if plan is None:  # full or fragmented: key by key from here
                        plan_ok = False
                if plan is not None:
                    reps = plan[plan_at]
                    need = plan_need
                    plan_at += 1
            if reps is None:
                if run_left:  # allocating below: the run's rest goes back
                    run_seg.alloc.release(run_off, run_left * run_need)
                    run_left = 0
                if plan is not None:  # (likewise the plan's)
                    self._unplan(plan, plan_at, plan_size)
                    plan = None
                    frees = [seg.alloc.free for seg in pool]
                if fast and key not in pending:
                    j = frees.index(max(frees)) if len(frees) > 1 else 0
                    seg = pool[j]
                    alloc = seg.alloc
                    before = alloc.used
                    off = alloc.allocate(size)
                    if off >= 0:
                        frees[j] = alloc.free
                        reps = (seg, off)
                        need = alloc.used - before
            if reps is not None:
                used = pool_used[_MEM] + need
                pool_used[_MEM] = used
                isize = sizes_get(size)
                pending[key] = Pending(intern(size) if isize is None else isize, reps, 0,
                                       None, client_id, now)
                out[i] = reps
                if used > high * cap:  # what is carved ahead goes back before evicting
                    if run_left:
                        run_seg.alloc.release(run_off, run_left * run_need)
                        run_left = 0
                    if plan is not None:
                        self._unplan(plan, plan_at, plan_size)
                        plan = None
                    self.evict(_MEM)
                    cap = self.pool_cap[_MEM]
                    frees = [seg.alloc.free for seg in pool]
                continue
            code, p = self.put_start(client_id, key, size)
            if code:
                codes[i] = int(code)
            else:
                out[i] = p.replicas
            cap = self.pool_cap[_MEM]  # the slow path may have evicted
            fast = 0 < len(pool) <= 32
            frees = [seg.alloc.free for seg in pool] if fast else []
        if run_left:
            run_seg.alloc.release(run_off, run_left * run_need)
        if plan is not None:
            self._unplan(plan, plan_at, plan_size)

    @staticmethod
    def _plan_run(pool: list[Segment], frees: list[int], size: int, m: int
                  ) -> list[tuple[Segment, int]] | None:
        """The ``(segment, offset)`` of each of ``m`` allocations of ``size``
        as put_start_many's key-by-key path would make them (each on the
        segment with the most free bytes, the first on ties: ``frees`` is
        theirs), carved per segment with ``Allocator.allocate_run`` (the
        ranges ``allocate`` would give one by one). Shorter when the pool
        runs out of free bytes; None (nothing carved) when a segment's free
        space is too fragmented to give what its free bytes promise (that
        key would take the general path) or the segments align differently."""
        need = pool[0].alloc.aligned(size)
        s = len(pool)
        if any(seg.alloc.aligned(size) != need for seg in pool):
            return None
        lo = min(frees)
        if max(frees) - lo < need and lo >= need * (m // s + 1):
            # frees within one allocation of each other, room for every pick:
            # each round picks every segment once, most free first (first on
            # ties), and leaves them in the same order
            ranked = sorted(range(s), key=lambda j: (-frees[j], j))
            q, r = divmod(m, s)
            segs = [pool[j] for j in ranked]
            offs = [0] * s
            for rank, seg in enumerate(segs):
                want = q + (rank < r)
                if not want:
                    break
                off, k = seg.alloc.allocate_run(size, want)
                if k != want:  # fragmented: give back what was carved
                    if k:
                        seg.alloc.release(off, k * need)
                    for back in range(rank):
                        segs[back].alloc.release(offs[back], (q + (back < r)) * need)
                    return None
                offs[rank] = off
            return [(segs[t % s], offs[t % s] + (t // s) * need) for t in range(m)]
        sim = frees[:]
        counts = [0] * s
        order: list[int] = []
        for _ in range(m):
            top = max(sim)
            if top < need:
                break
            j = sim.index(top)
            sim[j] = top - need
            counts[j] += 1
            order.append(j)
        carved: list[list[int]] = [[] for _ in pool]
        for j, want in enumerate(counts):
            alloc = pool[j].alloc
            got = carved[j]
            while len(got) < want:
                off, k = alloc.allocate_run(size, want - len(got))
                if k == 0:  # fragmented: give back what was carved
                    for jj in range(j + 1):
                        for o in carved[jj]:
                            pool[jj].alloc.release(o, need)
                    return None
                got.extend(range(off, off + k * need, need))
        its = [iter(c) for c in carved]
        return [(pool[j], next(its[j])) for j in order]

    @staticmethod
    def _unplan(plan: list[tuple[Segment, int]], used: int, size: int) -> None:
        """Give back the ranges (of ``size``) of ``plan`` past its first ``used``."""
        for seg, off in plan[used:]:
            seg.alloc.release(off, size)

    def put_end(self, client_id: str, key: str) -> int:
        """Make an in-flight put COMPLETE (readable, journaled)."""
        p = self.pending.get(key)
        if p is None:
            return OK if key in self.objects else ErrorCode.OBJECT_NOT_FOUND
        if p.client_id != client_id:
            return ErrorCode.INVALID_WRITE
        del self.pending[key]
        reps = p.replicas
        objects = self.objects
        shard = objects.shards[hash(key) & objects.mask]
        flags = p.flags
        if p.pin or p.group or key in shard:  # pin, group or upsert: the general path
            flags = self._commit_flags(key, p, shard.get(key))
        elif len(reps) == 2:  # fast path: one replica of a new, unpinned object
            seg = reps[0]
            if seg.state == _DEAD:
                return ErrorCode.OBJECT_NOT_FOUND
            shard[key] = Obj(p.size, reps, flags, p.checksum, self._writer(client_id))
            seg.keys.add(key)
            if self.journaling:
                self.records.append([_REC_PUT, key, p.size, flags, p.checksum,
                                     [seg.id, reps[1]]])
            return OK
        if any(reps[i].state == _DEAD for i in range(0, len(reps), 2)):
            reps = tuple(x for i in range(0, len(reps), 2) if reps[i].state != _DEAD
                         for x in (reps[i], reps[i + 1]))
            if not reps:
                return ErrorCode.OBJECT_NOT_FOUND
        old = shard.get(key)
        if old is not None:
            self._retire(key, old)
        self._complete(key, p.size, reps, flags, p.checksum, self._writer(client_id))
        if p.group and old is None:
            self.group_of[key] = p.group
            self.groups.setdefault(p.group, set()).add(key)
        return OK

    def put_commit(self, client_id: str, placeholder: str, key: str) -> int:
        """Make ``client_id``'s pending put ``placeholder`` (a reservation) the
        pending put of ``key`` and commit it as :meth:`put_end` does (the same
        record). OBJECT_NOT_FOUND: no such pending put of this client;
        OBJECT_ALREADY_EXISTS: ``key`` is stored or in flight (as put_start
        answers; the reservation stays)."""
        code = self._name_reserved(client_id, placeholder, key)
        return code if code else self.put_end(client_id, key)

    def put_commit_many(self, client_id: str, placeholders: list[str], keys: list[str],
                        max_key: int) -> list[int]:
        """:meth:`put_commit` of each ``(placeholders[i], keys[i])`` (INVALID_KEY
        for an empty or too long key), in one pass; the per-key codes."""
        if len(placeholders) != len(keys):
            raise ValueError("placeholders and keys differ in length")
        return self._commit_many(client_id, placeholders, keys, max_key)

    def _name_reserved(self, client_id: str, placeholder: str, key: str) -> int:
        """Make the pending put ``placeholder`` of ``client_id`` that of ``key``
        (not committed yet); put_commit's codes."""
        p = self.pending.get(placeholder)
        if p is None or p.client_id != client_id:
            return ErrorCode.OBJECT_NOT_FOUND
        objects = self.objects
        if key in objects.shards[hash(key) & objects.mask]:
            return ErrorCode.OBJECT_ALREADY_EXISTS
        other = self.pending.get(key)
        if other is not None and not self._preempt(key, other, self.clock()):
            return ErrorCode.OBJECT_ALREADY_EXISTS
        del self.pending[placeholder]
        self.pending[key] = p
        self.clients[client_id] = self.clock()
        return OK

    def put_end_many(self, client_id: str, keys: list[str], max_key: int) -> list[int]:
        """PUT_END of many keys, as :meth:`put_end` key by key (INVALID_KEY for
        an empty or too long key), in one pass; the per-key codes."""
        return self._commit_many(client_id, None, keys, max_key)

    def _commit_many(self, client_id: str, placeholders: list[str] | None, keys: list[str],
                     max_key: int) -> list[int]:
        """:meth:`put_end` of each key (``placeholders`` None), or
        :meth:`put_commit` of each ``(placeholders[i], keys[i])``, in one pass;
        the per-key codes. A new, unpinned, ungrouped object with one live
        replica (the common case) commits inline: put_end's fast path."""
        n = len(keys)
        codes = [0] * n
        bad_key = int(ErrorCode.INVALID_KEY)
        not_found = int(ErrorCode.OBJECT_NOT_FOUND)
        exists = int(ErrorCode.OBJECT_ALREADY_EXISTS)
        pending = self.pending
        get = pending.get
        shards, mask = self.objects.shards, self.objects.mask
        records = self.records if self.journaling else None
        append = records.append if records is not None else None
        writer = self._writer(client_id)
        put_end = self.put_end
        preempt = self._preempt
        # a commit names its reservation first (_name_reserved inline: one clock
        # read for the batch, and no naming of a pending put the fast path drops)
        now = self.clock() if placeholders is not None else 0.0
        stamped = False
        last_seg: Any = None  # a batch mostly fills one segment: its key set's add at hand
        seg_add: Any = None
        for i in range(n):
            key = keys[i]
            if key < KEY_MIN or len(key) > max_key:
                codes[i] = bad_key
                continue
            shard = shards[hash(key) & mask]
            if placeholders is None:
                p = get(key)
                if p is None or p.client_id != client_id or p.pin or p.group:
                    codes[i] = int(put_end(client_id, key))
                    continue
                reps = p.replicas
                if len(reps) != 2 or key in shard or reps[0].state == _DEAD:
                    codes[i] = int(put_end(client_id, key))
                    continue
                del pending[key]
            else:
                placeholder = placeholders[i]
                p = get(placeholder)
                if p is None or p.client_id != client_id:
                    codes[i] = not_found
                    continue
                if key in shard:
                    codes[i] = exists
                    continue
                other = get(key)
                if other is not None and not preempt(key, other, now):
                    codes[i] = exists
                    continue
                if not stamped:
                    self.clients[client_id] = now
                    stamped = True
                del pending[placeholder]
                reps = p.replicas
                if p.pin or p.group or len(reps) != 2 or reps[0].state == _DEAD:
                    pending[key] = p  # put_end's general path
                    codes[i] = int(put_end(client_id, key))
                    continue
            seg = reps[0]  # a new, unpinned, ungrouped object with one live replica
            size, flags, checksum = p.size, p.flags, p.checksum
            shard[key] = Obj(size, reps, flags, checksum, writer)
            if seg is not last_seg:
                last_seg, seg_add = seg, seg.keys.add
            seg_add(key)
            if append is not None:
                append([_REC_PUT, key, size, flags, checksum, [seg.id, reps[1]]])
        return codes

    def _leave_group(self, key: str) -> None:
        group = self.group_of.pop(key, None)
        if group is not None:
            members = self.groups[group]
            members.discard(key)
            if not members:
                del self.groups[group]

    def _lease_group(self, key: str, obj: Obj, lease: float) -> None:
        """A read of grouped ``key``: lease every member of its group (only when
        this object's lease was past its first half: repeated reads cost one
        lookup)."""
        if obj.lease - self.lease_s / 2 > self.clock():
            return
        get = self.objects.get
        for member in self.groups[self.group_of[key]]:
            other = get(member)
            if other is not None and other.lease < lease:
                other.lease = lease

    def _writer(self, client_id: str) -> str:
        """``client_id`` as one shared str per writer (Obj.writer)."""
        writers = self._writers
        got = writers.get(client_id)
        if got is None:
            if len(writers) >= 65536:
                writers.clear()
            got = writers[client_id] = client_id
        return got

    def _commit_flags(self, key: str, p: Pending, old: Obj | None) -> int:
        """The flags (and soft pin deadline) of ``p`` committing over ``old``."""
        flags = p.flags
        soft = self.soft_until
        if old is not None:
            flags |= old.flags & HARD_PIN  # an upsert keeps the hard pin
        if p.pin > 0:
            flags |= SOFT_PIN
            soft[key] = self.clock() + p.pin
        elif p.pin == 0 and old is not None and old.flags & SOFT_PIN \
                and soft.get(key, 0.0) > self.clock():
            flags |= SOFT_PIN  # PRESERVE: the replaced object's deadline stays
        else:
            flags &= ~SOFT_PIN
            soft.pop(key, None)
        return flags

    def _retire(self, key: str, old: Obj) -> None:
        """Take a replaced object out (no journal record: the new object's PUT
        record replaces it on replay). Its space is freed once its read lease
        has ended: a reader may still be copying the old bytes."""
        del self.objects[key]
        reps = old.replicas
        for i in range(0, len(reps), 2):
            reps[i].keys.discard(key)
        self.hold_replicas(reps, old.size, max(old.lease, self.lease_grace_until))
        self.replaced += 1

    def hold_replicas(self, reps: tuple[Any, ...], size: int, until: float) -> None:
        """Free ``reps`` now, or at ``until`` (clock()) when that is later."""
        if until <= self.clock():
            self._free_replicas(reps, size)
        else:
            heapq.heappush(self._held, (until, next(self._held_seq), reps, size))

    def _complete(self, key: str, size: int, reps: tuple[Any, ...], flags: int,
                  checksum: Any, writer: str = "") -> Obj:
        obj = Obj(size, reps, flags, checksum, writer)
        objects = self.objects
        objects.shards[hash(key) & objects.mask][key] = obj
        if not self.journaling:  # replay, a standby: no record to build
            for i in range(0, len(reps), 2):
                reps[i].keys.add(key)
            return obj
        wire: list[Any] = []
        for i in range(0, len(reps), 2):
            seg = reps[i]
            seg.keys.add(key)
            wire += (seg.id, reps[i + 1])
        self.records.append([_REC_PUT, key, size, flags, checksum, wire])
        return obj

    def put_revoke(self, client_id: str, key: str) -> int:
        p = self.pending.get(key)
        if p is None:
            return ErrorCode.OBJECT_NOT_FOUND
        if p.client_id != client_id:
            return ErrorCode.INVALID_WRITE
        del self.pending[key]
        self._release_pending(key, p)
        return OK

    # ---------------------------------------------------------------- reads
    def get_replicas(self, key: str) -> tuple[int, Any]:
        """(OK, (obj, active flat replicas)) and a fresh lease; or an error code."""
        objects = self.objects
        shard = objects.shards[hash(key) & objects.mask]
        obj = shard.get(key)
        if obj is None:
            if key in self.pending:
                return ErrorCode.REPLICA_IS_NOT_READY, None
            return ErrorCode.OBJECT_NOT_FOUND, None
        reps = obj.replicas
        if len(reps) != 2 or reps[0].state != _ACTIVE:
            reps = tuple(x for i in range(0, len(reps), 2) if reps[i].state == SegState.ACTIVE
                         for x in (reps[i], reps[i + 1]))
            if not reps:
                # only a suspect owner holds it: its memory may well be there
                # (a busy process, a same-host shm read needs no owner CPU)
                reps = tuple(x for i in range(0, len(obj.replicas), 2)
                             if obj.replicas[i].state == _SUSPECT
                             for x in (obj.replicas[i], obj.replicas[i + 1]))
            if not reps:
                if all(r.state == SegState.DEAD for r in obj.replicas[::2]):
                    return ErrorCode.OBJECT_NOT_FOUND, None
                return ErrorCode.REPLICA_IS_NOT_READY, None
        lease = self.clock() + self.lease_s
        if self.group_of and key in self.group_of:
            self._lease_group(key, obj, lease)
        obj.lease = lease
        obj.tick = next(_TICKS)
        del shard[key]
        shard[key] = obj  # LRU: most recent at the end of its shard
        return OK, (obj, reps)

    def get_replicas_many(self, keys: list[str], start: int, max_key: int, codes: list[int],
                          objs: list[Any], reps_out: list[Any]) -> int:
        """:meth:`get_replicas` of ``keys[start:]`` in one pass, into ``codes``,
        ``objs`` and ``reps_out`` (the active flat replicas) at each key's index;
        code INVALID_KEY for an empty or too long key. Returns the index of the
        first key served from a disk replica, which ends the pass (``len(keys)``
        when none): the caller runs its disk-hit hook (a promotion may place and
        evict) and resumes after it, so the hook sees what the per-key path
        does. One lease stamp for the pass; keys whose replicas are not one
        active memory segment (several replicas, a disk, suspect or dead
        segment) and missing keys take :meth:`get_replicas` itself."""
        objects = self.objects
        shards, mask = objects.shards, objects.mask
        grouped = self.group_of
        tick = _TICKS.__next__
        n = len(keys)
        # one C-speed length check of the batch spares a per-key one
        check = start > 0 or (n > 0 and (min(keys) < KEY_MIN  # empty or reserved
                                         or max(map(len, keys)) > max_key))
        lease = self.clock() + self.lease_s
        for i in range(start, n):
            key = keys[i]
            if check and (key < KEY_MIN or len(key) > max_key):
                codes[i] = _INVALID_KEY
                continue
            shard = shards[hash(key) & mask]
            obj = shard.get(key)
            if obj is None or len(reps := obj.replicas) != 2 \
                    or (seg := reps[0]).state is not _ACTIVE or seg.kind is _FILE:
                code, val = self.get_replicas(key)
                if code:
                    codes[i] = int(code)
                    continue
                objs[i], reps = val
                reps_out[i] = reps
                if reps[0].kind is _FILE:
                    return i
                continue
            if grouped and key in grouped:
                self._lease_group(key, obj, lease)
            obj.lease = lease
            obj.tick = tick()
            del shard[key]
            shard[key] = obj  # LRU: most recent at the end of its shard
            objs[i] = obj
            reps_out[i] = reps
        return n

    def exist(self, key: str) -> bool:
        objects = self.objects
        shard = objects.shards[hash(key) & objects.mask]
        obj = shard.get(key)
        if obj is None:
            return False
        if not any(s.state != SegState.DEAD for s in obj.replicas[::2]):
            return False
        lease = self.clock() + self.lease_s
        if self.group_of and key in self.group_of:
            self._lease_group(key, obj, lease)
        obj.lease = lease
        obj.tick = next(_TICKS)
        del shard[key]
        shard[key] = obj
        return True

    def exist_many(self, keys: list[str], max_key: int) -> tuple[list[int], list[bool]]:
        """:meth:`exist` of many keys in one pass: (codes, found); code
        INVALID_KEY (found False) for an empty or too long key."""
        objects = self.objects
        shards, mask = objects.shards, objects.mask
        grouped = self.group_of
        tick = _TICKS.__next__
        bad_key = int(ErrorCode.INVALID_KEY)
        codes: list[int] = []
        found: list[bool] = []
        lease = self.clock() + self.lease_s
        for key in keys:
            if key < KEY_MIN or len(key) > max_key:
                codes.append(bad_key)
                found.append(False)
                continue
            codes.append(0)
            shard = shards[hash(key) & mask]
            obj = shard.get(key)
            if obj is None:
                found.append(False)
                continue
            reps = obj.replicas
            if (reps[0].state == _DEAD) if len(reps) == 2 else \
                    not any(s.state != _DEAD for s in reps[::2]):
                found.append(False)
                continue
            if grouped and key in grouped:
                self._lease_group(key, obj, lease)
            obj.lease = lease
            obj.tick = tick()
            del shard[key]
            shard[key] = obj  # LRU: most recent at the end of its shard
            found.append(True)
        return codes, found

    def get_size(self, key: str) -> tuple[int, Any]:
        obj = self.objects.get(key)
        if obj is None:
            if key in self.pending:
                return ErrorCode.REPLICA_IS_NOT_READY, None
            return ErrorCode.OBJECT_NOT_FOUND, None
        return OK, obj.size

    # ---------------------------------------------------------------- removal
    def _remove_obj(self, key: str, obj: Obj) -> None:
        del self.objects[key]
        if obj.flags & SOFT_PIN:
            self.soft_until.pop(key, None)
        if self.group_of:
            self._leave_group(key)
        reps = obj.replicas
        for i in range(0, len(reps), 2):
            reps[i].keys.discard(key)
        self._free_replicas(reps, obj.size)
        if self.journaling:
            self.records.append([Rec.REMOVE, key])

    def remove(self, key: str, force: bool = False) -> int:
        obj = self.objects.get(key)
        if obj is None:
            if key in self.pending:
                return ErrorCode.REPLICA_IS_NOT_READY
            return ErrorCode.OBJECT_NOT_FOUND
        if not force and max(obj.lease, self.lease_grace_until) > self.clock():
            self.lease_refusals += 1
            return ErrorCode.OBJECT_HAS_LEASE
        self._remove_obj(key, obj)
        return OK

    def replica_clear(self, client_id: str, key: str, segment_id: str = "") -> int:
        """Clear ``key``'s replicas on ``segment_id`` ("" = every replica: the
        object goes), as Mooncake's BatchReplicaClear: only the object's writer
        may (PERMISSION_DENIED; an object restored after a restart has no
        recorded writer: any client may), not while read-leased
        (OBJECT_HAS_LEASE); OBJECT_NOT_FOUND when missing (or pending), or
        holding no replica on the segment. The last replica's clear removes the
        object. Journaled (REMOVE or DROP_REPLICA)."""
        obj = self.objects.get(key)
        if obj is None:
            return ErrorCode.OBJECT_NOT_FOUND
        if obj.writer and obj.writer != client_id:
            return ErrorCode.PERMISSION_DENIED
        if max(obj.lease, self.lease_grace_until) > self.clock():
            self.lease_refusals += 1
            return ErrorCode.OBJECT_HAS_LEASE
        if not segment_id:
            self._remove_obj(key, obj)
            return OK
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
            return ErrorCode.OBJECT_NOT_FOUND
        if not kept:
            self._remove_obj(key, obj)
            return OK
        obj.replicas = tuple(kept)
        gone[0].keys.discard(key)
        self._free_replicas(tuple(gone), obj.size)
        if self.journaling:
            self.records.append([Rec.DROP_REPLICA, key, segment_id])
        return OK

    def allocate_on(self, seg: Segment, size: int) -> int:
        """Allocate ``size`` bytes on ``seg`` itself (ACTIVE), evicting from its
        pool once when it is full; the offset, or -1."""
        if seg.state != _ACTIVE:
            return -1
        for attempt in range(2):
            before = seg.alloc.used
            off = seg.alloc.allocate(size)
            if off >= 0:
                self.pool_used[seg.kind] += seg.alloc.used - before
                return off
            if attempt or not self.evict(seg.kind, need=size):
                break
        return -1

    def remove_all(self, force: bool = False) -> int:
        now = self.clock()
        if not force and self.lease_grace_until > now:
            return 0  # every object counts as leased
        victims = [(k, o) for k, o in self.objects.items() if force or o.lease <= now]
        for k, o in victims:
            self._remove_obj(k, o)
        return len(victims)

    def remove_matching(self, match: Callable[[str], bool], force: bool = False,
                        prefix: str = "", exclude_prefix: str = "") -> int:
        """Remove every complete object whose key starts with ``prefix``, does
        not start with ``exclude_prefix`` (when given) and, with ``prefix``
        stripped, satisfies ``match``; leased ones only with ``force``. One
        pass over the directory (as REMOVE_ALL). Return the count removed."""
        now = self.clock()
        if not force and self.lease_grace_until > now:
            return 0  # every object counts as leased
        cut = len(prefix)
        victims = [(k, o) for k, o in self.objects.items()
                   if (force or o.lease <= now) and k.startswith(prefix)
                   and not (exclude_prefix and k.startswith(exclude_prefix))
                   and match(k[cut:])]
        for k, o in victims:
            self._remove_obj(k, o)
        return len(victims)

    # ---------------------------------------------------------------- eviction
    def _pool_bytes(self, obj: Obj, kind: SegmentKind) -> int:
        reps = obj.replicas
        n = 0
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.kind == kind and seg.state == SegState.ACTIVE:
                n += seg.alloc.aligned(obj.size)
        return n

    def evict(self, kind: SegmentKind, need: int = 0) -> int:
        """Evict approx-LRU unleased, unpinned objects with replicas in pool
        ``kind`` until usage is ``eviction_ratio`` below the high watermark
        (and at least ``need`` bytes were freed). Soft-pinned objects go only
        after the rest; hard-pinned never. Return bytes freed.

        Without ``need`` (watermark eviction) at most ``eviction_batch``
        objects go per call; if the pool is still above target it is left in
        ``evicting`` and the loop continues with ``evict_step`` (no stall)."""
        cap = self.pool_cap[kind]
        if cap <= 0:
            self.evicting.discard(kind)
            return 0
        target = max(0.0, self.cfg.eviction_high_watermark - self.cfg.eviction_ratio) * cap
        to_free = max(self.pool_used[kind] - target, need)
        if to_free <= 0:
            self.evicting.discard(kind)
            return 0
        limit = (1 << 62) if need else self.cfg.eviction_batch
        limited = False
        now = self.clock()
        if self.lease_grace_until > now:  # every object counts as leased
            self.evicting.discard(kind)
            return 0
        victims: list[tuple[str, Obj]] = []
        taken: set[str] = set()
        soft: list[tuple[str, Obj]] = []
        freed = 0
        scanned = 0
        max_scan = self.cfg.eviction_max_scan
        for key, obj in self.objects.lru_items():
            scanned += 1
            if scanned > max_scan:
                break
            if obj.flags & HARD_PIN or obj.lease > now:
                continue
            b = self._pool_bytes(obj, kind)
            if not b:
                continue
            if obj.flags & SOFT_PIN:
                if self.soft_until.get(key, 0.0) > now:
                    soft.append((key, obj))
                    continue
                obj.flags &= ~SOFT_PIN  # its pin ended: ordinary cache now
                self.soft_until.pop(key, None)
            if key in taken:  # a group member taken with an earlier victim
                continue
            victims.append((key, obj))
            freed += b
            if self.group_of and key in self.group_of:
                freed += self._group_victims(key, kind, now, victims, taken)
            if freed >= to_free:
                break
            if len(victims) >= limit:
                limited = True
                break
        if not limited:
            for key, obj in soft:
                if freed >= to_free or len(victims) >= limit:
                    break
                victims.append((key, obj))
                freed += self._pool_bytes(obj, kind)
        actual = 0
        for key, obj in victims:
            actual += self.evict_object(key, obj, kind)
        if victims:
            log.debug("evicted %d objects (%d B) from %s pool", len(victims), actual, kind.name)
        if limited and actual and self.pool_used[kind] > target:
            self.evicting.add(kind)  # continue in the next loop iteration
        else:
            self.evicting.discard(kind)
        return actual

    def _group_victims(self, key: str, kind: SegmentKind, now: float,
                       victims: list[tuple[str, Obj]], taken: set[str]) -> int:
        """Eviction picked grouped ``key``: add the other members of its group
        that are evictable on their own (not leased, not pinned, not chosen
        yet, with bytes in pool ``kind``) to ``victims`` and ``taken``; return
        their bytes."""
        chosen = {k for k, _ in victims}
        get = self.objects.get
        soft = self.soft_until
        added = 0
        for member in self.groups[self.group_of[key]]:
            obj = get(member)
            if obj is None or member in chosen or obj.lease > now or obj.flags & HARD_PIN \
                    or (obj.flags & SOFT_PIN and soft.get(member, 0.0) > now):
                continue
            b = self._pool_bytes(obj, kind)
            if b:
                victims.append((member, obj))
                taken.add(member)
                added += b
        return added

    def evict_step(self) -> int:
        """Continue watermark eviction (one batch per pool); return bytes freed."""
        return sum(self.evict(kind) for kind in list(self.evicting))

    def evict_object(self, key: str, obj: Obj, kind: SegmentKind) -> int:
        """Free ``obj``'s replicas in pool ``kind`` (unless the policy took it);
        remove the object when no replica is left. Return bytes freed."""
        if self.policy.on_evict(self, key, obj, kind):
            return 0
        reps = obj.replicas
        kept: list[Any] = []
        gone: list[Any] = []
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.kind == kind and seg.state == SegState.ACTIVE:
                gone += (seg, reps[i + 1])
            elif seg.state != SegState.DEAD:
                kept += (seg, reps[i + 1])
        before = self.pool_used[kind]
        self.evictions += 1
        if not kept:
            self._remove_obj(key, obj)
        else:
            obj.replicas = tuple(kept)
            for i in range(0, len(gone), 2):
                gone[i].keys.discard(key)
                if self.journaling:
                    self.records.append([Rec.DROP_REPLICA, key, gone[i].id])
            self._free_replicas(tuple(gone), obj.size)
        freed = before - self.pool_used[kind]
        self.evicted_bytes += freed
        return freed

    # ---------------------------------------------------------------- durability
    def snapshot_record(self, key: str) -> list[Any] | None:
        """The snapshot record of ``key`` now, or None if it is gone."""
        obj = self.objects.get(key)
        if obj is None:
            return None
        reps = obj.replicas
        if len(reps) == 2 and reps[0].state != SegState.DEAD:
            return [key, obj.size, obj.flags, obj.checksum, [reps[0].id, reps[1]]]
        wire: list[Any] = []
        for i in range(0, len(reps), 2):
            if reps[i].state != SegState.DEAD:
                wire += (reps[i].id, reps[i + 1])
        return [key, obj.size, obj.flags, obj.checksum, wire] if wire else None

    def segment_wires(self) -> list[dict[str, Any]]:
        return [s.wire for s in self.segments.values()]

    def restore_segment(self, wire: dict[str, Any]) -> None:
        """Apply a MOUNT record while restoring: the segment awaits its owner."""
        desc = SegmentDescriptor.from_wire(wire)
        seg = self.segments.get(desc.segment_id)
        if seg is not None:
            seg.desc, seg.owner, seg.wire = desc, desc.client_id, desc.to_wire()
            return
        seg = Segment(desc, self._alignment(desc.kind), SegState.AWAITING)
        self.segments[seg.id] = seg

    def restore_object(self, key: str, size: int, flags: int, checksum: Any,
                       wire: list[Any]) -> None:
        """Apply a PUT record while restoring (replicas on unknown segments are skipped)."""
        objects = self.objects
        old = objects.shards[hash(key) & objects.mask].get(key)
        if old is not None:
            self._remove_obj(key, old)
        reps: list[Any] = []
        segments = self.segments
        for i in range(0, len(wire), 2):
            seg = segments.get(wire[i])
            if seg is None:
                continue
            try:
                seg.alloc.reserve(wire[i + 1], size)
            except KVPoolError as exc:
                # expected with a fuzzy snapshot: the journal replay fixes it
                log.debug("restore: %s: %s", key, exc)
                continue
            reps += (seg, wire[i + 1])
        if reps:
            self._complete(key, self._intern_size(size), tuple(reps), flags, checksum)

    def bulk_load(self, segments: list[dict[str, Any]], records: Iterable[list[Any]]) -> int:
        """Load a snapshot into an empty directory fast: objects first, then
        each segment's allocator rebuilt from its sorted ranges. A replica
        overlapping an earlier one (possible in a fuzzy snapshot; the journal
        replay fixes it) is dropped. Return the number of objects loaded."""
        for wire in segments:
            self.restore_segment(wire)
        segs = self.segments
        objects = self.objects
        intern = self._intern_size
        for key, size, flags, checksum, wire in records:
            reps: list[Any] = []
            for i in range(0, len(wire), 2):
                seg = segs.get(wire[i])
                if seg is not None:
                    reps += (seg, wire[i + 1])
            if reps and key not in objects:
                objects[key] = Obj(intern(size), tuple(reps), flags, checksum)
        per_seg: dict[Segment, list[tuple[int, str]]] = {seg: [] for seg in segs.values()}
        for key, obj in objects.items():
            oreps = obj.replicas
            for i in range(0, len(oreps), 2):
                per_seg[oreps[i]].append((oreps[i + 1], key))
        for seg, entries in per_seg.items():
            entries.sort()
            alloc = seg.alloc
            ranges: list[tuple[int, int]] = []
            pos = 0
            keys = seg.keys
            for off, key in entries:
                obj = objects[key]
                length = alloc.aligned(obj.size)
                if off < pos or off % alloc.alignment or off + length > alloc.capacity:
                    log.debug("bulk load: dropping replica of %s on %s (conflict)", key, seg.id)
                    old = obj.replicas
                    obj.replicas = tuple(x for j in range(0, len(old), 2)
                                         if not (old[j] is seg and old[j + 1] == off)
                                         for x in (old[j], old[j + 1]))
                    continue
                ranges.append((off, length))
                keys.add(key)
                pos = off + length
            alloc.rebuild(ranges)
        empty = [k for k, o in objects.items() if not o.replicas]
        for k in empty:
            del objects[k]
        return len(objects)

    def apply_record(self, rec: list[Any]) -> None:
        """Replay one journal record (restore); raises on a malformed record."""
        tag = rec[0]
        if tag == _REC_PUT:  # the common record first
            self.restore_object(rec[1], int(rec[2]), int(rec[3]), rec[4], list(rec[5]))
        elif tag == Rec.MOUNT:
            self.restore_segment(rec[1])
        elif tag == Rec.DROP_SEGMENT:
            seg = self.segments.get(rec[1])
            if seg is not None:
                self.drop_segment(seg, "journal")
                self.purge_step(1 << 62)
        elif tag == Rec.REMOVE:
            obj = self.objects.get(rec[1])
            if obj is not None:
                self._remove_obj(rec[1], obj)
        elif tag == Rec.DROP_REPLICA:
            obj = self.objects.get(rec[1])
            seg = self.segments.get(rec[2])
            if obj is not None and seg is not None:
                reps = obj.replicas
                kept: list[Any] = []
                for i in range(0, len(reps), 2):
                    if reps[i] is seg:
                        seg.alloc.release(reps[i + 1], obj.size)
                        seg.keys.discard(rec[1])
                    else:
                        kept += (reps[i], reps[i + 1])
                if kept:
                    obj.replicas = tuple(kept)
                else:
                    self._remove_obj(rec[1], obj)
        else:
            raise ValueError(f"unknown journal record tag {tag!r}")

    def apply_records(self, records: list[list[Any]]) -> list[tuple[Any, Exception]]:
        """Replay ``records`` as :meth:`apply_record` one by one (an HA standby
        applies a group commit's at once); the PUT of a new key with one
        replica, the common record, in one pass without a call per record,
        and a run of them placed back to back in one segment (a leader
        allocates in order) reserved with one allocator call. Return the
        records that failed with their errors (the rest applied)."""
        shards, mask = self.objects.shards, self.objects.mask
        segments = self.segments
        intern = self._intern_size
        fast = not self.journaling  # the fast path builds no record
        failed: list[tuple[Any, Exception]] = []
        # the run: (record, shard) of the new objects placed in ``run_seg`` at
        # ``[run_start, run_end)`` whose space is not reserved yet
        run: list[tuple[list[Any], dict[str, Obj]]] = []
        run_seg: Segment | None = None
        run_start = run_end = 0
        for rec in records:
            try:
                if rec[0] == _REC_PUT and fast:
                    key = rec[1]
                    wire = rec[5]
                    shard = shards[hash(key) & mask]
                    if len(wire) == 2 and key not in shard:
                        seg = segments.get(wire[0])
                        if seg is None:
                            continue  # as restore_object: replicas on unknown segments go
                        off = wire[1]
                        size = rec[2]
                        if type(off) is int and type(size) is int:
                            a = seg.alloc.alignment
                            if seg is not run_seg or off != run_end:
                                if run:
                                    self._reserve_run(run_seg, run_start, run_end, run)
                                run_seg = seg
                                run_start = off
                            shard[key] = Obj(intern(size), (seg, off), int(rec[3]), rec[4])
                            seg.keys.add(key)
                            run.append((rec, shard))
                            run_end = off + ((size + a - 1) & -a if size > 0 else a)
                            continue
                if run:  # before anything that may depend on the allocator
                    self._reserve_run(run_seg, run_start, run_end, run)
                self.apply_record(rec)
            except Exception as exc:
                failed.append((rec, exc))
        if run:
            self._reserve_run(run_seg, run_start, run_end, run)
        return failed

    def _reserve_run(self, seg: Segment | None, start: int, end: int,
                     run: list[tuple[list[Any], dict[str, Obj]]]) -> None:
        """Reserve the space of ``run`` (new objects placed back to back at
        ``[start, end)`` in ``seg``) and empty it. One call for all of them;
        if that range is not wholly free, object by object, dropping those
        whose space is not free (as :meth:`restore_object`)."""
        assert seg is not None
        try:
            seg.alloc.reserve(start, end - start)
        except KVPoolError:
            for rec, shard in run:
                key = rec[1]
                try:
                    seg.alloc.reserve(rec[5][1], rec[2])
                except KVPoolError as exc:
                    log.debug("restore: %s: %s", key, exc)
                    del shard[key]
                    seg.keys.discard(key)
        run.clear()

    def finish_restore(self) -> None:
        """After replay: every segment awaits its owner (``client_ttl_s +
        client_grace_s``; a live owner pings within a second)."""
        self.restored_at = self.clock()
        self.awaiting_deadline = self.restored_at + self.cfg.client_ttl_s \
            + self.cfg.client_grace_s
        self.awaiting.clear()
        for seg in self.segments.values():
            seg.state = SegState.AWAITING
            self.awaiting.setdefault(seg.owner, set()).add(seg.id)
        self.policy.after_restore(self)
        self.records.clear()

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        return {
            "objects": len(self.objects),
            "pending": len(self.pending),
            "segments": len(self.segments),
            "clients": len(self.clients),
            "memory_used": self.pool_used[_MEM],
            "memory_capacity": self.pool_cap[_MEM],
            "file_used": self.pool_used[_FILE],
            "file_capacity": self.pool_cap[_FILE],
            "bytes_used": self.pool_used[_MEM] + self.pool_used[_FILE],
            "bytes_capacity": self.pool_cap[_MEM] + self.pool_cap[_FILE],
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
            "lease_refusals": self.lease_refusals,
            "preemptions": self.preemptions,
            "expired_clients": self.expired_clients,
            "suspect_clients": len(self.suspects),
            "suspect_segments": sum(1 for s in self.segments.values() if s.state == _SUSPECT),
            "suspected_clients": self.suspected_clients,
            "revived_clients": self.revived_clients,
            "spilled": self.spilled,
            "held_puts": len(self._held),
            "replaced": self.replaced,
            "groups": len(self.groups),
            "soft_pinned": len(self.soft_until),
        }

"""The tenant table: per-tenant usage, quotas and counters (docs/tenants.md).

A tenant's objects are the stored keys in its namespace
(:func:`kvpool.core.tenants.tenant_of`). Usage is counted in bytes of
object data: an object of ``size`` bytes with ``m`` memory and ``d`` file
(disk) replicas uses ``m * size`` of memory and ``d * size`` of disk; a put
in flight counts from its start (its replicas are allocated then) until it
is committed (the object's then), revoked or preempted. The directory
calls the table at its single points of allocation and freeing (put start,
commit, a replica set changed, an object forgotten), so usage never needs a
scan; after a restart (snapshot + journal replay) or an HA promotion it is
rebuilt from the objects (:meth:`TenantTable.rebuild`), so it cannot drift.

Cost for the ``default`` tenant: its usage is not tracked unless it is
listed under ``tenants:`` (``track_default``); every hook is behind a
``key < " "`` test (a scoped key starts with U+001F, a reservation with
NUL; no caller's key starts below U+0020), so default keys pay one string
comparison. Its objects, hits, misses and evictions in :meth:`TenantTable.rows` are
then derived (the totals less the named tenants'), its bytes not counted.

Quotas come from the config (``tenants:``, ``default_tenant_quota:`` for
the tenants not listed there) and from TENANT_SET (journaled as
:class:`~kvpool.master.records.TenantSet`, in snapshots, replicated; a
live setting wins over the file). A put start that would take a tenant
over a quota makes room by evicting that tenant's own least recently used
evictable objects (:meth:`TenantTable.admit`, the eviction policy
asked for victims in the tenant's own use order); when they cannot free
enough the key fails with QUOTA_EXCEEDED and nothing changes. A commit
naming a reservation (PUT_COMMIT, BATCH_PUT_COMMIT: the reservation was
in no tenant) is admitted the same way (:meth:`TenantTable.renamed`). A
tenant that has had to make room keeps its complete objects in the order
they took their place there, with the use stamp (``Obj.tick``) they had
then (``Tenant.objs``); a read costs the tenant nothing (it stamps the
object, as every read does), and the choice of victims walks that order,
moving an object used since it took its place to the back (CLOCK's second
chance, :meth:`TenantTable.use_order`): approximately least recently used,
as the pool-wide order is. That order is built the first time the tenant
must make room (one pass over the object table, the tenant's objects
sorted by their stamps), so a tenant that never reaches its quota pays only
its counters.

Hits and misses are counted per batch (the op boundary scopes a request's
keys into one tenant's namespace): a batch's are the tenant its key check's
lower bound names (:meth:`TenantTable.of_bound`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.core.tenants import DEFAULT_TENANT, TENANT_SEP, scope_prefix
from kvpool.master.config import MasterConfig, TenantQuota, tenant_quotas
from kvpool.master.objects import Obj

if TYPE_CHECKING:
    from kvpool.master.eviction import Evictor

__all__ = ["NO_PREFIX", "UNLIMITED", "Tenant", "TenantTable"]

log = logging.getLogger(__name__)

#: a limit that is never reached (-1 on the wire and in the config)
UNLIMITED = 1 << 62
#: a prefix no stored key starts with (a tenant name is never empty): the
#: hot loops' "no tenant at hand" (they test ``key.startswith(t.prefix)``
#: before asking :meth:`TenantTable.of`)
NO_PREFIX = TENANT_SEP * 2
_MEM = SegmentKind.MEMORY
_FILE = SegmentKind.FILE
QUOTA_EXCEEDED = int(ErrorCode.QUOTA_EXCEEDED)


def _limit(v: int | None) -> int:
    return UNLIMITED if v is None or v < 0 else v


def _first(item: tuple[int, str, Obj]) -> int:
    return item[0]


def _wire(v: int) -> int:
    return -1 if v >= UNLIMITED else v


class Tenant:
    """One tenant's quotas (``UNLIMITED`` when none), usage and counters."""

    __slots__ = ("disk", "disk_quota", "evictions", "guaranteed", "hits", "mem",
                 "memory_quota", "misses", "name", "objects", "objs", "prefix", "refusals")

    def __init__(self, name: str, memory: int, disk: int, guaranteed: int) -> None:
        self.name = name
        #: what its stored keys start with (:data:`NO_PREFIX` for the default tenant)
        self.prefix = scope_prefix(name) or NO_PREFIX
        self.memory_quota = memory
        self.disk_quota = disk
        self.guaranteed = guaranteed
        self.mem = 0
        self.disk = 0
        self.objects = 0  # complete objects
        #: complete objects -> their use stamp when they took their place here
        #: (see the module docstring); None until the tenant first makes room
        self.objs: dict[str, int] | None = None
        self.hits = self.misses = self.evictions = self.refusals = 0

    def quotas(self) -> tuple[int, int, int]:
        """(memory, disk, guaranteed) as the wire states them: -1 = unlimited/none."""
        return _wire(self.memory_quota), _wire(self.disk_quota), _wire(self.guaranteed)


def _bound_tenant(key_min: str) -> str | None:
    """The tenant whose scope's bound ``key_min`` is (its namespace and
    U+0020), or None for any other bound: the default tenant's."""
    if key_min >= " " or key_min < TENANT_SEP:
        return None
    end = key_min.find(TENANT_SEP, 1)
    return key_min[1:end] if end > 1 else None


class _ReadCounts:
    """Hits and misses of reads that no :class:`Tenant` counts."""

    __slots__ = ("hits", "misses")

    def __init__(self) -> None:
        self.hits = self.misses = 0


class TenantTable:
    """The tenants a master knows (see the module docstring)."""

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        #: the configured quotas (``tenants:``), sizes parsed
        self.configured = tenant_quotas(cfg.tenants)
        self.default_quota = cfg.default_tenant_quota
        self.by_name: dict[str, Tenant] = {}
        #: quotas set live (TENANT_SET), name -> (memory, disk, guaranteed), wire form
        self.live: dict[str, tuple[int, int, int]] = {}
        self.track_default = DEFAULT_TENANT in self.configured
        #: a restore loaded or replayed a key of a tenant's namespace (below
        #: " "); without one, and without a tenant met by a request (``by_name``),
        #: :meth:`rebuild` scans no keys
        self.namespaced = False
        self.default: Tenant | None = None
        self.guarantees = False
        #: the reads of the default tenant while it is untracked (no Tenant)
        self.untracked_reads = _ReadCounts()
        self.evictor: Evictor | None = None  # set by the directory
        # the namespace prefix of the tenant :meth:`of` found last ("\x1fname\x1f")
        self._last_prefix = NO_PREFIX
        self._last: Tenant | None = None
        # a batch's key_min -> its tenant (of_bound; None: the untracked default)
        # and what counts its reads (:meth:`reads`), for every bound met
        self._bounds: dict[str, tuple[Tenant | None, Tenant | _ReadCounts]] = {}
        for name in self.configured:
            self.tenant(name)

    # ---------------------------------------------------------------- lookup
    def _quota_of(self, name: str) -> tuple[int, int, int]:
        got = self.live.get(name)
        if got is not None:
            return _limit(got[0]), _limit(got[1]), _limit(got[2])
        q: TenantQuota = self.configured.get(name) or self.default_quota
        if name == DEFAULT_TENANT and name not in self.configured:
            return UNLIMITED, UNLIMITED, UNLIMITED
        return _limit(q.memory), _limit(q.disk), _limit(q.guaranteed)

    def tenant(self, name: str) -> Tenant:
        """Tenant ``name`` (canonical), created with its configured quotas."""
        t = self.by_name.get(name)
        if t is None:
            t = self.by_name[name] = Tenant(name, *self._quota_of(name))
            if name == DEFAULT_TENANT:
                self.default = t
                self.track_default = True
                # its reads so far carry over; later ones count on it
                t.hits, t.misses = self.untracked_reads.hits, self.untracked_reads.misses
                self._bounds.clear()
            if t.guaranteed < UNLIMITED:
                self.guarantees = True
        return t

    def of(self, key: str) -> Tenant | None:
        """The tracked tenant of stored key ``key``, or None (the default
        tenant's key while it is untracked)."""
        # a batch is one tenant's: the last namespace seen is checked first
        if key.startswith(self._last_prefix):
            return self._last
        if key < " " and key.startswith(TENANT_SEP):  # (a caller's key: one comparison)
            end = key.find(TENANT_SEP, 1)
            if end > 1:
                name = key[1:end]
                t = self.by_name.get(name)
                if t is None:
                    t = self.tenant(name)
                self._last_prefix = key[:end + 1]
                self._last = t
                return t
        return self.default

    def of_bound(self, key_min: str, create: bool = True) -> Tenant | None:
        """The tracked tenant of a batch whose keys were checked against the
        lower bound ``key_min`` (a batch is one tenant's: the op boundary
        scoped its keys), or None. A tenant's scope's bound (its namespace
        and U+0020, :class:`~kvpool.master.keys.Scope`) names that tenant
        (one dict lookup once met; ``create``: the tenant is made if it is
        new, as a put makes it, not as a read); any other bound (``KEY_MIN``,
        a reservation's ``RESERVED_KEY_PREFIX``) admits only keys outside
        every namespace: the default tenant's."""
        try:
            return self._bounds[key_min][0]  # (one dict lookup per request once met)
        except KeyError:
            pass
        got = self._bound(key_min, create)
        return None if got is None else got[0]

    def _bound(self, key_min: str, create: bool
               ) -> tuple[Tenant | None, Tenant | _ReadCounts] | None:
        """``key_min``'s entry of :attr:`_bounds` (its tenant, what counts
        its reads), remembered; None for a tenant not met when ``create`` is
        False (not remembered: its first put makes it)."""
        name = _bound_tenant(key_min)
        if name is None:
            t = self.default
        else:
            t = self.tenant(name) if create else self.by_name.get(name)
            if t is None:
                return None
        got = self._bounds[key_min] = (t, self.untracked_reads if t is None else t)
        return got

    # ---------------------------------------------------------------- quotas
    def set_quota(self, name: str, memory: int, disk: int, guaranteed: int) -> Tenant:
        """TENANT_SET (or its record replayed): the live quotas of ``name``
        (-1 = unlimited/none). Nothing is evicted here: a tenant left above a
        lowered quota keeps its objects and its next puts make room within it."""
        self.live[name] = (_wire(_limit(memory)), _wire(_limit(disk)),
                           _wire(_limit(guaranteed)))
        t = self.tenant(name)
        t.memory_quota, t.disk_quota, t.guaranteed = self._quota_of(name)
        self.guarantees = any(x.guaranteed < UNLIMITED for x in self.by_name.values())
        return t

    def live_records(self) -> list[list[Any]]:
        """The live quotas, ``[[name, memory, disk, guaranteed], ...]`` (a snapshot's)."""
        return [[n, *q] for n, q in self.live.items()]

    def load_live(self, rows: Any) -> None:
        """Apply a snapshot's :meth:`live_records`."""
        for name, memory, disk, guaranteed in rows or ():
            self.set_quota(str(name), int(memory), int(disk), int(guaranteed))

    def admit(self, t: Tenant, size: int, mem_n: int, disk_n: int,
              replacing: tuple[str, Obj] | None = None) -> bool:
        """Whether a put of ``size`` bytes with ``mem_n`` memory and ``disk_n``
        disk replicas fits ``t``'s quotas, after evicting ``t``'s own least
        recently used objects when it would not. False (counted as a
        refusal): nothing was evicted. ``replacing``: the ``(key, object)``
        an upsert replaces (its bytes go at the commit: they count as free
        here, and it is no victim)."""
        old_mem = old_disk = 0
        if replacing is not None:
            old = replacing[1]
            for seg in old.replicas[::2]:
                if seg.kind is _FILE:
                    old_disk += old.size
                else:
                    old_mem += old.size
        over_mem = t.mem - old_mem + size * mem_n - t.memory_quota if mem_n else 0
        over_disk = t.disk - old_disk + size * disk_n - t.disk_quota if disk_n else 0
        if over_mem <= 0 and over_disk <= 0:
            return True
        if size * mem_n > t.memory_quota or size * disk_n > t.disk_quota:
            t.refusals += 1  # more than the whole quota: nothing to look for
            return False
        skip = None if replacing is None else replacing[0]
        mem_victims = self.victims(t, _MEM, over_mem, skip) if over_mem > 0 else []
        disk_victims = self.victims(t, _FILE, over_disk, skip) if over_disk > 0 else []
        if mem_victims is None or disk_victims is None:
            t.refusals += 1
            return False
        ev = self.evictor
        assert ev is not None
        get = ev.objects.get
        for kind, victims in ((_MEM, mem_victims), (_FILE, disk_victims)):
            for key, obj in victims:
                if get(key) is obj:  # (not gone with an earlier victim)
                    ev.evict_object(key, obj, kind, offload=False)
        return True

    def victims(self, t: Tenant, kind: SegmentKind, need: int,
                skip: str | None = None) -> list[tuple[str, Obj]] | None:
        """``t``'s own evictable objects (``skip`` not among them) freeing at
        least ``need`` bytes of its ``kind`` usage, least recently used first
        (the eviction policy asked over ``t``'s use order), or None when they
        cannot."""
        ev = self.evictor
        assert ev is not None
        now = ev.clock()
        if ev.objects.lease_grace_until > now:
            return None
        # the policy counts the space its victims free (aligned): ask again
        # for the shortfall while that frees less of the tenant's bytes
        ask = need
        got = -1
        pool_bytes = ev.segtab.pool_bytes
        only: Callable[[str, Obj], bool] | None = None
        if skip is not None:
            def only(k: str, _obj: Obj) -> bool:
                return k != skip
        while True:
            chosen = ev.policy.evict(kind, ask, 1 << 62, now, self.use_order(t), only)
            if chosen is None or len(chosen[0]) <= got:
                return None
            got = len(chosen[0])
            freed = space = 0
            out: list[tuple[str, Obj]] = []
            for key, obj in chosen[0]:
                reps = obj.replicas
                freed += sum(1 for s in reps[::2] if s.kind is kind) * obj.size
                space += pool_bytes(reps, obj.size, kind)
                out.append((key, obj))
                if freed >= need:
                    return out
            ask = space + need - freed  # more than these: at least one more victim

    def use_order(self, t: Tenant) -> Iterator[tuple[str, Obj]]:
        """``t``'s objects, least recently used first (approximately): its
        order, skipping each object used since it took its place (those come
        last, by use); once the walk ends they move to the back of the order
        with their current stamps."""
        ev = self.evictor
        assert ev is not None
        objs = t.objs
        if objs is None:  # the first time: the tenant's objects by their stamps
            prefix = t.prefix
            if t is self.default:  # the keys outside every namespace
                mine = sorted((o.tick, k) for k, o in ev.objects.items()
                              if not k.startswith(TENANT_SEP))
            else:
                mine = sorted((o.tick, k) for k, o in ev.objects.items() if k.startswith(prefix))
            objs = t.objs = {k: tick for tick, k in mine}
        get = ev.objects.get
        moved: list[tuple[int, str, Obj]] = []
        try:
            for key, at in objs.items():
                obj = get(key)
                if obj is None:
                    continue
                if obj.tick > at:
                    moved.append((obj.tick, key, obj))
                    continue
                yield key, obj
            moved.sort(key=_first)
            for _, key, obj in moved:
                yield key, obj
        finally:
            for tick, key, _obj in moved:
                if key in objs:
                    del objs[key]
                    objs[key] = tick

    def over_share(self) -> Callable[[str, Obj], bool]:
        """Pool-wide eviction's first pass: whether an object may go because
        its tenant is above its guaranteed share (a tenant without one always
        is), counting what the pass has chosen so far."""
        left: dict[Tenant, int] = {}
        track = self.track_default

        def pick(key: str, obj: Obj) -> bool:
            if not (key < " " or track):
                return True
            t = self.of(key)
            if t is None or t.guaranteed >= UNLIMITED:
                return True
            spare = left.get(t)
            if spare is None:
                spare = t.mem - t.guaranteed
            if spare <= 0:
                return False
            left[t] = spare - obj.size
            return True

        return pick

    # ---------------------------------------------------------------- accounting
    @staticmethod
    def charge(t: Tenant, reps: tuple[Any, ...], size: int) -> None:
        """Add ``size`` (negative: take away) per replica in ``reps`` to ``t``'s usage."""
        if len(reps) == 2:
            if reps[0].kind is _FILE:
                t.disk += size
            else:
                t.mem += size
            return
        for i in range(0, len(reps), 2):
            if reps[i].kind is _FILE:
                t.disk += size
            else:
                t.mem += size

    def started(self, key: str, reps: tuple[Any, ...], size: int) -> None:
        """A put of ``key`` was placed on ``reps``."""
        t = self.of(key)
        if t is not None:
            self.charge(t, reps, size)

    def released(self, key: str, reps: tuple[Any, ...], size: int) -> None:
        """A put in flight of ``key`` (on ``reps``) is gone uncommitted."""
        t = self.of(key)
        if t is not None:
            self.charge(t, reps, -size)

    def renamed(self, t: Tenant | None, reps: tuple[Any, ...], size: int) -> bool:
        """A reservation's put (on ``reps``; the reservation was the default
        tenant's) becomes a put of a key of tenant ``t`` (PUT_COMMIT,
        BATCH_PUT_COMMIT; None: the default tenant, untracked), admitted as
        a put start is (:meth:`admit`: its own least recently used objects
        make room). False (counted as a refusal): it does not fit, nothing
        was evicted or charged. A tenant without quotas pays no check."""
        a = self.default
        if a is t:
            return True
        if t is not None and len(reps) == 2 and reps[0].kind is not _FILE:
            # a reservation's shape, one memory replica: the quota test inline
            if t.mem + size > t.memory_quota and not self.admit(t, size, 1, 0):
                return False
            t.mem += size
        elif t is not None:
            if t.memory_quota < UNLIMITED or t.disk_quota < UNLIMITED:
                disk_n = sum(1 for s in reps[::2] if s.kind is _FILE)
                if not self.admit(t, size, len(reps) // 2 - disk_n, disk_n):
                    return False
            self.charge(t, reps, size)
        if a is not None:
            self.charge(a, reps, -size)
        return True

    def stored(self, key: str, obj: Obj) -> None:
        """``key`` became the COMPLETE ``obj`` (its put's charge stays)."""
        t = self.of(key)
        if t is not None:
            t.objects += 1
            if t.objs is not None:
                t.objs[key] = obj.tick

    def forgotten(self, key: str, obj: Obj) -> None:
        """``obj`` left the table with its replicas."""
        t = self.of(key)
        if t is not None:
            reps = obj.replicas
            if len(reps) == 2 and reps[0].kind is not _FILE:  # the common case, inline
                t.mem -= obj.size
            else:
                self.charge(t, reps, -obj.size)
            t.objects -= 1
            if t.objs is not None:
                t.objs.pop(key, None)

    def rereps(self, key: str, size: int, old: tuple[Any, ...], new: tuple[Any, ...]) -> None:
        """``key``'s replica set changed from ``old`` to ``new``."""
        t = self.of(key)
        if t is not None:
            self.charge(t, old, -size)
            self.charge(t, new, size)

    def reads(self, key_min: str, hits: int, misses: int) -> None:
        """A batch of reads whose keys were checked against ``key_min`` (as
        :meth:`of_bound`'s) found ``hits`` objects and missed ``misses``
        (counted for its tenant: one dict lookup). A read of a tenant that
        never stored anything is not counted: a read alone does not make a
        tenant."""
        try:
            counts = self._bounds[key_min][1]
        except KeyError:
            got = self._bound(key_min, False)
            if got is None:
                return
            counts = got[1]
        counts.hits += hits
        counts.misses += misses

    def rebuild(self, objects: Any, pending: dict[str, Any]) -> None:
        """Recount every tenant's usage and use order from the objects and the
        puts in flight (after a restore or an HA promotion). The objects are
        scanned only if the default tenant is tracked, a tenant other than
        the default was met (every request of one names it) or a restore
        loaded a key of a tenant's namespace (:attr:`namespaced`)."""
        for t in self.by_name.values():
            t.mem = t.disk = 0
            t.objects = 0
            t.objs = None  # built again when needed
        track = self.track_default
        scan = track or self.namespaced or any(n != DEFAULT_TENANT for n in self.by_name)
        for shard in objects.shards if scan else ():
            # untracked default tenant: only the keys below " " (min: a C-level
            # scan, so a shard without tenants' keys costs no Python per key)
            if not shard or (not track and min(shard) >= " "):
                continue
            for key in (shard if track else filter(" ".__gt__, shard)):
                owner = self.of(key)
                if owner is not None:
                    obj = shard[key]
                    self.charge(owner, obj.replicas, obj.size)
                    owner.objects += 1
        unloaded = objects.unloaded if scan else None
        for key, reps, size in unloaded.entries(not track) if unloaded is not None else ():
            owner = self.of(key)  # (a restored object not loaded yet)
            if owner is not None:
                self.charge(owner, reps, size)
                owner.objects += 1
        for key, p in pending.items():
            if key < " " or track:
                self.started(key, p.replicas, p.size)

    # ---------------------------------------------------------------- reading
    def rows(self, objects: int) -> list[dict[str, Any]]:
        """One row per tenant (TENANT_LIST, /metrics): quotas (-1 unlimited),
        usage and counters. An untracked default tenant's objects and
        evictions are derived from the totals (``objects``: the table's count)
        less the named tenants', its hits and misses are
        :attr:`untracked_reads`; its bytes used are None (not counted)."""
        out: list[dict[str, Any]] = []
        named = [t for t in self.by_name.values() if t.name != DEFAULT_TENANT]
        for t in sorted(self.by_name.values(), key=lambda x: (x.name != DEFAULT_TENANT, x.name)):
            out.append(self._row(t.name, t.quotas(), t.mem, t.disk, t.objects, t.hits,
                                 t.misses, t.evictions, t.refusals))
        if self.default is None:
            ev = self.evictor
            out.insert(0, self._row(
                DEFAULT_TENANT, (-1, -1, -1), None, None,
                max(0, objects - sum(t.objects for t in named)),
                self.untracked_reads.hits, self.untracked_reads.misses,
                max(0, (ev.evictions if ev else 0) - sum(t.evictions for t in named)), 0))
        return out

    @staticmethod
    def _row(name: str, quotas: tuple[int, int, int], mem: int | None, disk: int | None,
             objects: int,
             hits: int, misses: int, evictions: int, refusals: int) -> dict[str, Any]:
        return {"name": name, "memory_quota": quotas[0], "disk_quota": quotas[1],
                "guaranteed": quotas[2], "memory_used": mem, "disk_used": disk,
                "objects": objects, "hits": hits, "misses": misses, "evictions": evictions,
                "refusals": refusals}

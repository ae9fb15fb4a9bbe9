"""The write path: puts started (replicas placed, the put in flight), committed
(the object COMPLETE and recorded) or revoked, and the space of abandoned
puts held until no late write can land in it.

Every form is a batch; a single key is a batch of one. A put with the
default options (one memory replica; no pin, checksum, group or upsert)
placed at once is done inline, per-key work only: the batch's runs of equal
sizes are placed together (:meth:`Placement.plan_run`), exactly where one
by one would have put them. Anything else takes the general step of the
same batch (:meth:`Writes._start_one`, :meth:`Writes._commit_one`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import KEY_MIN, RESERVED_KEY_PREFIX, SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.keys import (
    EXISTS,
    INVALID_PARAMS,
    INVALID_WRITE,
    NOT_FOUND,
    mark_bad_keys,
    valid_keys,
)
from kvpool.master.objects import HARD_PIN, SOFT_PIN, Obj, ObjectTable, Pending
from kvpool.master.placement import MakeRoom, Placement, unplan
from kvpool.master.records import Put
from kvpool.master.segments import SegmentTable, SegState

if TYPE_CHECKING:
    from kvpool.master.directory import Directory

__all__ = ["DEFAULT_PUT", "PutSpec", "Writes", "write_grant_ms"]

_OK = 0
QUOTA_EXCEEDED = int(ErrorCode.QUOTA_EXCEEDED)
_NO_ROOM = int(ErrorCode.NO_AVAILABLE_HANDLE)
_MEM = SegmentKind.MEMORY
_FILE = SegmentKind.FILE
_DEAD = SegState.DEAD
# Beyond a WRITE capability's expiry, how long a transfer server may still
# accept it (its capability_leeway_ms, 2 s by default, plus clock skew).
_WRITE_LEEWAY_S = 5.0
_NO_QUOTA = 1 << 62  # put_start_many's budget of a batch without a tracked tenant


def write_grant_ms(cfg: MasterConfig) -> int:
    """How long the WRITE capability granted with a put's replicas is valid:
    a big put over a slow link must not be cut off mid-way."""
    return max(cfg.capability_ttl_ms or cfg.lease_ttl_ms,
               int(cfg.put_start_discard_timeout_s * 1000))


class PutSpec(NamedTuple):
    """The options of a put, the same for every key of a batch.

    ``flags`` with SOFT_PIN: pinned for ``soft_pin_ms`` from the commit (-1:
    the configured default; 0: not pinned). ``replace`` (an upsert): an
    existing object stays readable, unchanged, until the commit swaps in the
    new one (its hard pin carries over; its soft pin too unless the new put
    pins anew or ``unpin``); an in-flight put of the key is preempted at
    once. Without ``replace`` an existing key is OBJECT_ALREADY_EXISTS."""

    replica_num: int = 1
    disk_replica_num: int = 0
    preferred: Sequence[str] = ()
    flags: int = 0
    soft_pin_ms: int = -1
    replace: bool = False
    unpin: bool = False


DEFAULT_PUT = PutSpec()


class Writes:
    """Puts in flight and their commits (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, clock: Callable[[], float], segtab: SegmentTable,
                 objects: ObjectTable, clients: dict[str, float], placement: Placement,
                 evict: MakeRoom, directory: Directory) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segtab = segtab
        self.objects = objects
        self.pending = objects.pending
        self.shards, self.mask = objects.shards, objects.mask  # (fixed for their life)
        self.pool_used = segtab.pool_used
        self.changes = objects.changes
        self.clients = clients
        self.placement = placement
        self.evict = evict
        self.directory = directory  # the tier hooks' argument
        self.max_key = cfg.max_key_length
        self.max_size = cfg.max_object_size
        self.high = cfg.eviction_high_watermark
        self.write_window_s = write_grant_ms(cfg) / 1000.0 + _WRITE_LEEWAY_S
        # space of abandoned puts, held while their writer may still write:
        # heap of (release time, seq, replicas, size)
        self._held: list[tuple[float, int, tuple[Any, ...], int]] = []
        self._held_seq = itertools.count()
        self.held_bytes = 0  # what _held holds, every replica counted
        self.preemptions = 0
        self.spilled = 0  # puts placed on disk because memory was full
        self.replaced = 0  # objects replaced by an upsert

    # ---------------------------------------------------------------- start
    def put_start_many(self, client_id: str, keys: Sequence[str], sizes: Sequence[int],
                       codes: list[int], out: list[Any], spec: PutSpec = DEFAULT_PUT,
                       checksums: Sequence[Any] | None = None,
                       groups: Sequence[str] | None = None, key_min: str = KEY_MIN,
                       max_key: int = 0, room_only: bool = False) -> None:
        """Start a put of each key: allocate its replicas and keep it in
        flight. ``room_only`` (reservations: space held ahead must never
        cost a stored object): keys of the default spec only, placed where
        they fit at once below the memory pool's high watermark, never by
        evicting, spilling to disk or over a quota; the others get
        NO_AVAILABLE_HANDLE. Key ``i`` sets ``codes[i]`` (INVALID_KEY for an empty, too
        long or reserved key (below ``key_min``; ``max_key`` 0: the
        configured length), INVALID_PARAMS for a size outside ``[1,
        max_object_size]``, OBJECT_ALREADY_EXISTS, NO_AVAILABLE_HANDLE, or,
        for ``groups[i]`` naming another group than an upserted object's,
        INVALID_PARAMS) and, when OK, ``out[i]`` = its flat replicas.
        ``checksums[i]``, ``groups[i]`` (the group it joins at the commit: ""
        none, None unset) go with key ``i``. The keys are one tenant's: the
        one ``key_min`` names (:meth:`TenantTable.of_bound`: a scope's bound
        its tenant; ``KEY_MIN`` and ``RESERVED_KEY_PREFIX`` the default)."""
        n = len(keys)
        max_key = max_key or self.max_key
        # (a single valid key, the single-key ops', needs no pass over the batch)
        bad = (n != 1 or keys[0] < key_min or len(keys[0]) > max_key) \
            and mark_bad_keys(keys, max_key, codes, key_min)
        max_size = self.max_size
        simple = checksums is None and groups is None and (spec is DEFAULT_PUT or (
            spec.replica_num == 1 and not spec.disk_replica_num and not spec.preferred
            and not spec.flags and spec.soft_pin_ms == -1 and not spec.replace
            and not spec.unpin))
        objects = self.objects
        if objects.unloaded is not None:
            objects.force(keys)  # (before the shards are indexed inline)
        shards = self.shards
        mask = self.mask
        pending = self.pending
        pool_used = self.pool_used
        high = self.high
        limit = high * self.segtab.pool_cap[_MEM]  # the memory pool's high watermark
        if room_only and not simple:
            for i in range(n):
                codes[i] = codes[i] or _NO_ROOM
            return
        sizes_get = objects._sizes.get
        # the batch's tenant (None: untracked), and its memory quota left less
        # what was placed inline for it (tt.mem is brought up to date before
        # anything else reads it: the general step, eviction, the end)
        tenants = objects.tenants
        tt = tenants.of_bound(key_min)
        # (without one, a budget never reached: the per-key steps are the same
        # for every batch, with no tenant test on the way)
        tleft = _NO_QUOTA if tt is None else tt.memory_quota - tt.mem
        now = self.clock()
        stamped = False
        # a run of equal sizes is placed at once (plan_run: the segment each key
        # would pick, its ranges carved); plan_at indexes the next key's
        # (segment, offset) in it. A run that cannot be planned: key by key
        # for the rest of the batch
        plan: list[tuple[Any, int]] | None = None
        plan_at = plan_size = plan_need = -1
        plan_ok = True
        for i in range(n):
            if bad and codes[i]:
                continue
            key = keys[i]
            size = sizes[i]
            if size <= 0 or size > max_size:
                codes[i] = INVALID_PARAMS
                continue
            if simple:
                if key in shards[hash(key) & mask]:
                    codes[i] = EXISTS
                    continue
                if not stamped:
                    self.clients[client_id] = now
                    stamped = True
                # the tenant at its quota: the general step makes room (or refuses)
                if size > tleft:
                    assert tt is not None
                    if room_only:
                        codes[i] = _NO_ROOM
                        continue
                    tt.mem = tt.memory_quota - tleft
                    if plan is not None:
                        unplan(plan, plan_at, plan_size)
                        plan = None
                    code, p = self._start_one(client_id, key, size, spec, None, None)
                    if code:
                        codes[i] = int(code)
                    else:
                        out[i] = p.replicas  # type: ignore[union-attr]
                    tleft = tt.memory_quota - tt.mem
                    limit = high * self.segtab.pool_cap[_MEM]
                    continue
                if plan_ok and key not in pending:
                    if plan is None or plan_at == len(plan) or size != plan_size:
                        if plan is not None and plan_at < len(plan):
                            unplan(plan, plan_at, plan_size)
                        m = i + 1
                        while m < n and sizes[m] == size:
                            m += 1
                        plan = self.placement.plan_run(size, m - i)
                        plan_at = 0
                        plan_size = size
                        if plan is None:
                            plan_ok = False
                        else:  # what each takes (Allocator.aligned, inline)
                            a = plan[0][0].alloc.alignment
                            plan_need = (size + a - 1) & -a
                    if plan is not None:
                        if room_only and pool_used[_MEM] + plan_need > limit:
                            codes[i] = _NO_ROOM  # (the plan's rest goes back at the end)
                            continue
                        reps = plan[plan_at]
                        plan_at += 1
                        used = pool_used[_MEM] + plan_need
                        pool_used[_MEM] = used
                        isize = sizes_get(size)
                        pending[key] = Pending(objects.intern_size(size) if isize is None
                                               else isize, reps, 0, None, client_id, now)
                        out[i] = reps
                        tleft -= size
                        if used > limit:
                            # what is carved ahead goes back before evicting
                            unplan(plan, plan_at, plan_size)
                            plan = None
                            if tt is not None:
                                tt.mem = tt.memory_quota - tleft
                            self.evict(_MEM, 0)
                            if tt is not None:
                                tleft = tt.memory_quota - tt.mem
                            limit = high * self.segtab.pool_cap[_MEM]
                        continue
                if plan is not None:  # placing below: the plan's rest goes back
                    unplan(plan, plan_at, plan_size)
                    plan = None
                if room_only:  # no run fits at once: the general step may evict
                    codes[i] = _NO_ROOM
                    continue
            if tt is not None:
                tt.mem = tt.memory_quota - tleft
            code, p = self._start_one(client_id, key, size, spec,
                                      None if checksums is None else checksums[i],
                                      None if groups is None else groups[i])
            if code:
                codes[i] = int(code)
            else:
                out[i] = p.replicas  # type: ignore[union-attr]
            if tt is not None:
                tleft = tt.memory_quota - tt.mem
            limit = high * self.segtab.pool_cap[_MEM]  # the general step may have evicted
        if tt is not None:
            tt.mem = tt.memory_quota - tleft
        if plan is not None and plan_at < len(plan):
            unplan(plan, plan_at, plan_size)

    def _start_one(self, client_id: str, key: str, size: int, spec: PutSpec, checksum: Any,
                   group: str | None) -> tuple[int, Pending | None]:
        """The general step of :meth:`put_start_many` for one (valid) key
        (whose restored object, if any, :meth:`put_start_many` made)."""
        objects = self.objects
        if key in self.shards[hash(key) & self.mask]:
            if not spec.replace:
                return ErrorCode.OBJECT_ALREADY_EXISTS, None
            if group is not None and group != objects.group_of.get(key, ""):
                return ErrorCode.INVALID_PARAMS, None
        now = self.clock()
        self.clients[client_id] = now
        flags = spec.flags
        pin = -1.0 if spec.unpin else 0.0
        if flags & SOFT_PIN:
            ms = self.cfg.soft_pin_ttl_ms if spec.soft_pin_ms < 0 else spec.soft_pin_ms
            if ms > 0:
                pin = ms / 1000.0
            else:  # a zero TTL commits the object as ordinary cache
                flags &= ~SOFT_PIN
                pin = -1.0
        p = self.pending.get(key)
        # an upsert takes the key over from an in-flight put at once
        if p is not None and not self._preempt(key, p, now, spec.replace):
            return ErrorCode.OBJECT_ALREADY_EXISTS, None
        rn, dn = spec.replica_num, spec.disk_replica_num
        tenants = objects.tenants
        t = None
        if key < " " or tenants.track_default:
            t = tenants.of(key)
            old = self.shards[hash(key) & self.mask].get(key)  # an upsert's
            if t is not None and not tenants.admit(t, size, rn, dn,
                                                   None if old is None else (key, old)):
                return ErrorCode.QUOTA_EXCEEDED, None
        out: list[Any] = []
        pref = list(spec.preferred)
        placement = self.placement
        if not (rn == 1 and not dn and not pref and placement.place_one(size, out)):
            got = placement.place(size, rn, _MEM, pref, out)
            # memory is full and eviction could not free it at once (its victims
            # wait for their copy to disk): the disk tier takes the object now
            d = self.directory
            spill = rn if rn and not got and d.hooks.spill_on_full(d) else 0
            if spill and t is not None and t.disk + size * spill > t.disk_quota:
                spill = 0  # the tenant's disk quota does not take it
            if dn or spill:
                if placement.place(size, max(dn, spill), _FILE, pref, out) and spill:
                    self.spilled += 1
        if not out:
            return ErrorCode.NO_AVAILABLE_HANDLE, None
        p = Pending(objects.intern_size(size), tuple(out), flags, checksum, client_id, now, pin,
                    group)
        self.pending[key] = p
        if t is not None:
            tenants.charge(t, p.replicas, size)  # type: ignore[union-attr]
        return _OK, p

    # ---------------------------------------------------------------- commit
    def commit_many(self, client_id: str, keys: Sequence[str],
                    placeholders: Sequence[str] | None = None, key_min: str = KEY_MIN,
                    max_key: int = 0) -> list[int]:
        """Make each key's put COMPLETE (readable, recorded); the per-key codes
        (INVALID_KEY; OBJECT_NOT_FOUND: no put of it in flight and no object;
        INVALID_WRITE: another client's put). With ``placeholders``, key
        ``i``'s put is the reservation ``placeholders[i]`` of this client,
        named ``keys[i]`` first (OBJECT_NOT_FOUND: no such reservation;
        OBJECT_ALREADY_EXISTS: the key is stored or in flight, the
        reservation stays; QUOTA_EXCEEDED: the key's tenant is at its quota
        and none of its own objects could make room, as at a put start, the
        reservation released). A new, unpinned, ungrouped object with one live
        replica (the common case) commits inline. ``key_min``/``max_key``
        (0: the configured length): the key check, as :meth:`put_start_many`."""
        n = len(keys)
        if placeholders is not None and len(placeholders) != n:
            raise ValueError("placeholders and keys differ in length")
        codes = [0] * n
        max_key = max_key or self.max_key
        bad = (n != 1 or keys[0] < key_min or len(keys[0]) > max_key) \
            and mark_bad_keys(keys, max_key, codes, key_min)  # (as in put_start_many)
        pending = self.pending
        get = pending.get
        if self.objects.unloaded is not None:
            self.objects.force(keys)  # (before the shards are indexed inline)
        shards = self.shards
        mask = self.mask
        changes = self.changes
        append = changes.records.append if changes.journaling else None
        objects = self.objects
        tenants = objects.tenants
        tt = tenants.of_bound(key_min)  # as in put_start_many
        # tt's use order, when it keeps one
        tobjs = None if tt is None else tt.objs
        # commits the general step made (it counts them for their tenant): the
        # inline ones are added to tt.objects at the end, with no per-key count
        general_ok = 0
        writer = objects._writers.get(client_id) or objects.writer(client_id)
        # a commit names its reservation first (one clock read for the batch,
        # and no naming of a pending put the inline path drops)
        now = self.clock() if placeholders is not None else 0.0
        stamped = False
        last_seg: Any = None  # a batch mostly fills one segment: its key set's add at hand
        seg_add: Any = None
        for i in range(n):
            if bad and codes[i]:
                continue
            key = keys[i]
            shard = shards[hash(key) & mask]
            if placeholders is None:
                p = get(key)
                if p is None or p.client_id != client_id or p.pin or p.group:
                    codes[i] = c = self._commit_one(client_id, key)
                    general_ok += not c
                    continue
                reps = p.replicas
                if len(reps) != 2 or key in shard or reps[0].state == _DEAD:
                    codes[i] = c = self._commit_one(client_id, key)
                    general_ok += not c
                    continue
                del pending[key]
            else:
                placeholder = placeholders[i]
                p = get(placeholder)
                if p is None or p.client_id != client_id:
                    codes[i] = NOT_FOUND
                    continue
                if key in shard:
                    codes[i] = EXISTS
                    continue
                other = get(key)
                if other is not None and not self._preempt(key, other, now):
                    codes[i] = EXISTS
                    continue
                if not stamped:
                    self.clients[client_id] = now
                    stamped = True
                del pending[placeholder]
                reps = p.replicas
                # (a key outside every namespace is the placeholder's tenant's)
                if key < " ":
                    if not tenants.renamed(tt, reps, p.size):
                        # over the key's tenant's quota, nothing of its own could go:
                        # the reservation goes back (its holder drops it on this code)
                        self._release(p, placeholder)
                        codes[i] = QUOTA_EXCEEDED
                        continue
                    if tt is not None:  # (making room may have started its use order)
                        tobjs = tt.objs
                if p.pin or p.group or len(reps) != 2 or reps[0].state == _DEAD:
                    pending[key] = p  # the general step
                    codes[i] = c = self._commit_one(client_id, key)
                    general_ok += not c
                    continue
            seg = reps[0]  # a new, unpinned, ungrouped object with one live replica
            size, flags, checksum = p.size, p.flags, p.checksum
            shard[key] = obj = Obj(size, reps, flags, checksum, writer)
            if tobjs is not None:  # (TenantTable.stored, inline: tt's use order)
                tobjs[key] = obj.tick
            if seg is not last_seg:
                last_seg, seg_add = seg, seg.keys.add
            seg_add(key)
            if append is not None:
                append(Put(key, size, flags, checksum, [seg.id, reps[1]]))
        if tt is not None:  # (TenantTable.stored, inline: each OK not the general step's)
            tt.objects += codes.count(0) - general_ok
        return codes

    def _commit_one(self, client_id: str, key: str) -> int:
        """The general step of :meth:`commit_many` for one (valid) key
        (whose restored object, if any, :meth:`commit_many` made)."""
        p = self.pending.get(key)
        objects = self.objects
        if p is None:
            return _OK if key in objects else NOT_FOUND
        if p.client_id != client_id:
            return INVALID_WRITE
        del self.pending[key]
        reps = p.replicas
        shard = self.shards[hash(key) & self.mask]
        flags = p.flags
        if p.pin or p.group or key in shard:  # pin, group or upsert
            flags = self._commit_flags(key, p, shard.get(key))
        if any(reps[i].state == _DEAD for i in range(0, len(reps), 2)):
            reps = tuple(x for i in range(0, len(reps), 2) if reps[i].state != _DEAD
                         for x in (reps[i], reps[i + 1]))
            tenants = objects.tenants
            if key < " " or tenants.track_default:
                tenants.rereps(key, p.size, p.replicas, reps)
            if not reps:
                return NOT_FOUND
        old = shard.get(key)
        if old is not None:
            self._retire(key, old)
        objects.complete(key, p.size, reps, flags, p.checksum, objects.writer(client_id))
        if p.group and old is None:
            objects.join_group(key, p.group)
        return _OK

    def _commit_flags(self, key: str, p: Pending, old: Obj | None) -> int:
        """The flags (and soft pin deadline) of ``p`` committing over ``old``."""
        flags = p.flags
        soft = self.objects.soft_until
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
        """Take a replaced object out (no record: the new object's PUT record
        replaces it on replay). Its space is freed once its read lease has
        ended: a reader may still be copying the old bytes."""
        del self.objects[key]
        tenants = self.objects.tenants
        if key < " " or tenants.track_default:
            tenants.forgotten(key, old)
        reps = old.replicas
        for i in range(0, len(reps), 2):
            reps[i].keys.discard(key)
        self.hold(reps, old.size, max(old.lease, self.objects.lease_grace_until))
        self.replaced += 1

    # ---------------------------------------------------------------- revoke, expiry
    def revoke_many(self, client_id: str, keys: Sequence[str], max_key: int = 0) -> list[int]:
        """Drop each key's put in flight (the caller's own; a reservation's
        placeholder too); the per-key codes (INVALID_KEY, OBJECT_NOT_FOUND,
        INVALID_WRITE: another client's). ``max_key``: 0, the configured
        length."""
        codes = [0] * len(keys)
        pending = self.pending
        for i, key in valid_keys(keys, max_key or self.cfg.max_key_length, codes,
                                 RESERVED_KEY_PREFIX):
            p = pending.get(key)
            if p is None:
                codes[i] = NOT_FOUND
            elif p.client_id != client_id:
                codes[i] = INVALID_WRITE
            else:
                del pending[key]
                self._release(p, key)
        return codes

    def _release(self, p: Pending, key: str) -> None:
        """Give back an abandoned put's space, once no write into it can land.

        A writer that gave up (its transfer timed out) may still have bytes
        on their way: queued in a stalled peer's socket, or in a copy thread.
        Reusing the space at once let such a late write overwrite the next
        object placed there (seen: a 2-byte object read back as the 'zz' of
        a revoked 100 KB put after its stalled holder resumed). So the space
        stays allocated until the WRITE capability granted with the put has
        expired everywhere (``write_window_s`` after the start). ``key``'s
        tenant no longer counts it."""
        tenants = self.objects.tenants
        if key < " " or tenants.track_default:
            tenants.released(key, p.replicas, p.size)
        self.hold(p.replicas, p.size, p.started + self.write_window_s)

    def _preempt(self, key: str, p: Pending, now: float, force: bool = False) -> bool:
        """Preempt ``p``, the in-flight put of ``key``, when its writer is
        presumed dead (it started over put_start_discard_timeout_s before
        ``now``) or ``force``: its space goes back as :meth:`_release` says.
        False: ``p`` stays in flight."""
        if not force and now - p.started <= self.cfg.put_start_discard_timeout_s:
            return False
        del self.pending[key]
        self._release(p, key)
        self.preemptions += 1
        return True

    def hold(self, reps: tuple[Any, ...], size: int, until: float) -> None:
        """Free ``reps`` now, or at ``until`` (clock()) when that is later."""
        if until <= self.clock():
            self.segtab.free(reps, size)
        else:
            heapq.heappush(self._held, (until, next(self._held_seq), reps, size))
            self.held_bytes += size * (len(reps) // 2)

    def held_note(self) -> str:
        """Why a put may find no room though the pool looks free: the bytes
        held for removed or abandoned objects' readers and writers, and when
        the first of them is freed ("" when none are held)."""
        held = self._held
        if not held:
            return ""
        wait = max(0.0, held[0][0] - self.clock())
        return (f" ({self.held_bytes} bytes of {len(held)} removed or abandoned objects are held "
                f"until their read leases or write grants end; the first is freed in about "
                f"{wait:.1f} s)")

    def sweep(self) -> int:
        """Revoke in-flight puts older than put_start_release_timeout (a
        reservation: than its write window) or whose client was dropped (a
        suspect client's puts stay); free the held space of abandoned puts
        whose write window passed. Return how many puts were revoked."""
        now = self.clock()
        held = self._held
        while held and held[0][0] <= now:
            _, _, reps, size = heapq.heappop(held)
            self.segtab.free(reps, size)
            self.held_bytes -= size * (len(reps) // 2)
        limit = self.cfg.put_start_release_timeout_s
        # a reservation (placeholder key) is of no use once its WRITE grant ended:
        # one whose holder never learnt of it (its reply lost) goes then
        resv = min(limit, self.write_window_s)
        clients = self.clients
        stale = [k for k, p in self.pending.items()
                 if now - p.started > (resv if k.startswith(RESERVED_KEY_PREFIX) else limit)
                 or p.client_id not in clients]
        for k in stale:
            self._release(self.pending.pop(k), k)
        return len(stale)

    def stats(self) -> dict[str, int]:
        return {"pending": len(self.pending), "preemptions": self.preemptions,
                "spilled": self.spilled, "held_puts": len(self._held),
                "held_bytes": self.held_bytes,
                "replaced": self.replaced}

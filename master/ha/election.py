"""Leader election and fencing for a master group on etcd.

Every instance of a group (same etcd, same cluster id) holds one etcd lease
(TTL ``T``, default 2 s) that carries its ``members/<id>`` key; a follower
that may lead campaigns with one txn::

    if create_revision(leader) == 0 and mod_revision(sync) == <as read>:
        put leader = LeaderInfo, lease = mine        -> elected
    else:
        range leader                                 -> follow it

The **epoch** of a term is the revision of that put (the key's
create_revision): etcd revisions only grow and every term creates the key
anew, so epochs grow across terms without a counter of our own.

**Fencing deadline.** The elector renews the lease every ``K`` (T/8). For a
renewal sent at local time ``t_send`` that etcd answered with TTL ``T``,
etcd expires the lease no earlier than ``t_send + T`` (it starts the TTL when
it processes the request, which is after we sent it; an etcd leader change
only extends leases). No successor can create the campaign key before that.
The leader acknowledges only while

    now < t_send + T * (1 - drift) - margin        (drift 0.5 %, margin 0.1 s)

measured on CLOCK_BOOTTIME (it keeps counting while the process is stopped
or the host suspends), so a deposed leader stops acknowledging at least
``margin + drift*T`` before another instance can be elected, whatever
happened to it (frozen, partitioned, etcd gone). It keeps leading, and
acknowledging, as long as one renewal succeeds every ``T - margin - K``
(1.65 s with the defaults).

**In-sync set.** ``sync`` holds ``{leader, epoch, members, any}``: the
standbys that hold every change the leader acknowledged (the leader waits
for all of them, and changes the set only through a txn guarded by its own
campaign key). Only the leader named there or one of those members may
campaign (``any``: everyone, for ``sync_standbys: 0``), so whoever wins holds
every acknowledged change. The campaign txn's guard on ``sync``'s
mod_revision makes that check atomic with the win.

Failover after kill -9 of the leader: its lease expires between ``T - K``
and ``T`` after the kill, etcd's lessor notices within 500 ms, the watchers
see the DELETE within a few ms and campaign: a new leader in
``[T - K, T + 0.5 s]`` plus one txn (1.75-2.5 s with the defaults).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.etcd import (
    Compare,
    CompareTarget,
    EtcdClient,
    EtcdError,
    EtcdTarget,
    LeaderInfo,
    LeaderResolver,
    MemberInfo,
    PutOp,
    RangeOp,
    group_keys,
)

__all__ = [
    "ElectionConfig",
    "ElectionState",
    "Elector",
    "Role",
    "SyncSet",
    "SyncWrite",
    "SyncWriter",
    "fence_clock",
]

log = logging.getLogger(__name__)

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def fence_clock() -> float:
    """Seconds on CLOCK_BOOTTIME: the clock every fencing deadline is measured on."""
    return time.clock_gettime(_BOOTTIME)


class Role(StrEnum):
    FOLLOWER = "follower"
    LEADER = "leader"  # elected and the lease confirmed: may acknowledge changes
    FENCED = "fenced"  # elected, but the lease is unconfirmed past the deadline: no acks


@dataclass
class ElectionConfig:
    """Timing of one instance's lease; the defaults give the bounds in the
    module docstring. ``lease_ttl_s`` is whole seconds (etcd's unit; etcd
    raises TTLs below its minimum, 2 s with its default timing)."""

    endpoints: tuple[str, ...]
    cluster_id: str = "default"
    lease_ttl_s: int = 2
    keepalive_interval_s: float = 0.0  # 0: lease_ttl_s / 8
    margin_s: float = 0.1
    clock_drift: float = 0.005
    etcd_timeout_s: float = 0.5  # per etcd call (a renewal also stops at the deadline)

    @property
    def keepalive_s(self) -> float:
        return self.keepalive_interval_s or self.lease_ttl_s / 8

    def validate(self) -> None:
        if self.lease_ttl_s < 1:
            raise ValueError("lease_ttl_s must be >= 1")
        if not 0 < self.keepalive_s < self.lease_ttl_s / 2:
            raise ValueError("keepalive interval must be in (0, lease_ttl_s / 2)")
        if not 0 <= self.margin_s < self.lease_ttl_s / 2:
            raise ValueError("margin_s must be in [0, lease_ttl_s / 2)")

    @classmethod
    def for_target(cls, target: EtcdTarget, **kw: object) -> ElectionConfig:
        return cls(target.endpoints, target.cluster_id, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SyncSet:
    """The in-sync set as stored in etcd (``revision``: its mod_revision, 0 absent)."""

    leader: str = ""
    epoch: int = 0
    members: tuple[str, ...] = ()
    any_eligible: bool = True
    revision: int = 0

    def eligible(self, instance_id: str) -> bool:
        """May ``instance_id`` campaign? (It holds every acknowledged change.)"""
        return (self.revision == 0 or self.any_eligible or instance_id == self.leader
                or instance_id in self.members)

    def encode(self) -> bytes:
        return json.dumps({"leader": self.leader, "epoch": self.epoch,
                           "members": list(self.members), "any": self.any_eligible}).encode()

    @classmethod
    def decode(cls, value: bytes, revision: int) -> SyncSet:
        d = json.loads(value)
        return cls(str(d.get("leader", "")), int(d.get("epoch", 0)),
                   tuple(str(m) for m in d.get("members", ())), bool(d.get("any", False)),
                   revision)


@dataclass(frozen=True)
class ElectionState:
    """A consistent view: our role, the epoch of the term we know of (ours
    when leading), the leader (None while none is known)."""

    role: Role = Role.FOLLOWER
    epoch: int = 0
    leader: LeaderInfo | None = None
    lease_deadline: float = 0.0  # fence_clock() time; meaningful when leading
    eligible: bool = True  # may this instance campaign now (sync set)?


@dataclass
class _Flags:
    wake: threading.Event = field(default_factory=threading.Event)
    leader_changed: bool = True
    resign: bool = False


class Elector:
    """One instance's lease, membership key and campaign.

    ``start()`` runs the election in a thread. The master asks
    ``may_acknowledge()`` right before replies that acknowledge changes go
    out (a float compare: cheap per loop pass). ``on_change`` callbacks get
    each new :class:`ElectionState` (called from the elector thread).
    ``close()`` resigns: the lease is revoked so a successor is elected at once.
    """

    def __init__(self, cfg: ElectionConfig, me: MemberInfo) -> None:
        cfg.validate()
        self.cfg = cfg
        self.me = me
        self.keys = group_keys(cfg.cluster_id)
        self._etcd = EtcdClient(cfg.endpoints, cfg.etcd_timeout_s)
        self._lease = 0
        self._lease_ttl = cfg.lease_ttl_s
        self._deadline = 0.0  # fence_clock() until which our lease surely lives
        self._next_keepalive = 0.0
        self._state = ElectionState()
        self._lock = threading.Lock()
        self._flags = _Flags()
        self._callbacks: list[Callable[[ElectionState], None]] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._resolver: LeaderResolver | None = None
        self._logged_ineligible = False
        #: may this instance campaign as a member of the in-sync set? (False
        #: while it does not hold the replicated state it was listed for: a
        #: restarted standby that has not caught up, one mid-snapshot)
        self.member_ready: Callable[[], bool] = lambda: True
        self.campaigns = 0
        self.renewals = 0
        self.renewal_failures = 0

    # ---------------------------------------------------------------- public
    def start(self) -> Elector:
        target = EtcdTarget(self.cfg.endpoints, self.cfg.cluster_id)
        self._resolver = LeaderResolver(target, self.cfg.etcd_timeout_s)
        self._resolver.on_change(self._on_leader_event)
        self._thread = threading.Thread(target=self._run, name="kvpool-elector", daemon=True)
        self._thread.start()
        return self

    def on_change(self, callback: Callable[[ElectionState], None]) -> None:
        self._callbacks.append(callback)

    def state(self) -> ElectionState:
        """The current state; its role reads ``FENCED`` from the moment the
        fencing deadline passes (the same clock check as
        :meth:`may_acknowledge`), even while the elector thread is still
        waiting on an etcd call and has not recorded it yet."""
        st = self._state
        if st.role is Role.LEADER and fence_clock() >= st.lease_deadline:
            return replace(st, role=Role.FENCED)
        return st

    @property
    def epoch(self) -> int:
        return self._state.epoch

    def may_acknowledge(self) -> bool:
        """True while this instance leads and its lease is surely alive."""
        st = self._state
        return st.role is Role.LEADER and fence_clock() < st.lease_deadline

    def wait_role(self, role: Role, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._state.role is role:
                return True
            time.sleep(0.01)
        return self._state.role is role

    def sync_set(self) -> SyncSet | None:
        kv = self._etcd.get(self.keys.sync)
        return SyncSet.decode(kv.value, kv.mod_revision) if kv is not None else None

    def set_sync_set(self, members: tuple[str, ...], any_eligible: bool) -> None:
        """Publish the in-sync set of this term (guarded by our campaign key),
        on the caller's thread. Raises KVPoolError: NOT_LEADER when we no
        longer lead, or COORDINATION_UNAVAILABLE when etcd cannot be reached.
        (The master publishes through a :class:`SyncWriter` instead: its loop
        must never wait on etcd.)"""
        st = self._state
        if st.role is Role.FOLLOWER:
            raise KVPoolError("not the leader", ErrorCode.NOT_LEADER)
        _write_sync_set(self._etcd, self.keys.leader, self.keys.sync, self.me.instance_id,
                        st.epoch, members, any_eligible)

    def resign(self) -> None:
        """Give up leadership now (the lease is revoked; a successor campaigns)."""
        self._flags.resign = True
        self._flags.wake.set()

    def close(self, resign: bool = True) -> None:
        self._closed = True
        self._flags.wake.set()
        if self._thread is not None:
            self._thread.join(5)
        if resign and self._lease:
            with contextlib.suppress(EtcdError):
                self._etcd.lease_revoke(self._lease)
        if self._resolver is not None:
            self._resolver.close()
        self._etcd.close()

    # ---------------------------------------------------------------- state
    def _publish(self, **changes: object) -> None:
        with self._lock:
            old = self._state
            new = replace(old, **changes)  # type: ignore[arg-type]
            self._state = new
        if (new.role, new.epoch, new.leader, new.eligible) != (
                old.role, old.epoch, old.leader, old.eligible):
            log.info("election %s/%s: %s epoch %d (leader %s)", self.cfg.cluster_id,
                     self.me.instance_id, new.role.value, new.epoch,
                     new.leader.instance_id if new.leader else "none")
            for cb in self._callbacks:
                try:
                    cb(new)
                except Exception:
                    log.exception("election callback failed")

    def _on_leader_event(self, _leader: LeaderInfo | None) -> None:
        self._flags.leader_changed = True
        self._flags.wake.set()

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        while not self._closed:
            try:
                self._step()
            except EtcdError as exc:
                log.warning("election %s: %s", self.me.instance_id, exc)
                self._next_keepalive = min(self._next_keepalive, fence_clock() + 0.1)
            except Exception:
                log.exception("election step failed")
            self._check_deadline()
            now = fence_clock()
            wait = self._next_keepalive - now
            st = self._state
            if st.role is Role.LEADER:
                wait = min(wait, st.lease_deadline - now)
            if not self._flags.wake.wait(max(0.005, min(wait, 0.5))):
                continue
            self._flags.wake.clear()

    def _check_deadline(self) -> None:
        st = self._state
        if st.role is Role.LEADER and fence_clock() >= st.lease_deadline:
            log.warning("election %s: lease not renewed by its deadline: acknowledgments "
                        "stop (epoch %d)", self.me.instance_id, st.epoch)
            self._publish(role=Role.FENCED)

    def _step(self) -> None:
        if self._flags.resign:
            self._flags.resign = False
            if self._lease:
                lease, self._lease = self._lease, 0
                self._publish(role=Role.FOLLOWER, lease_deadline=0.0)
                self._etcd.lease_revoke(lease)
        if not self._lease:
            self._grant()
        if fence_clock() >= self._next_keepalive:
            self._keepalive()
        if self._flags.leader_changed:
            self._follow()
            self._flags.leader_changed = False
        st = self._state
        if st.role is Role.FOLLOWER and st.leader is None and self._lease:
            self._campaign()

    def _grant(self) -> None:
        t_send = fence_clock()
        lease, ttl = self._etcd.lease_grant(self.cfg.lease_ttl_s)
        self._lease, self._lease_ttl = lease, ttl
        self._renewed(t_send, ttl)
        self._etcd.put(self.keys.member(self.me.instance_id), self.me.encode(), lease)
        log.info("election %s: lease %x (TTL %d s)", self.me.instance_id, lease, ttl)

    def _renewed(self, t_send: float, ttl: int) -> None:
        self._deadline = t_send + ttl * (1 - self.cfg.clock_drift) - self.cfg.margin_s
        self._next_keepalive = t_send + self.cfg.keepalive_s

    def _keepalive(self) -> None:
        t_send = fence_clock()
        st = self._state
        timeout = self.cfg.etcd_timeout_s
        if st.role is Role.LEADER:
            # never wait past the deadline: past it we stop acknowledging anyway
            timeout = max(0.02, min(timeout, st.lease_deadline - t_send))
        try:
            ttl = self._etcd.lease_keepalive(self._lease, timeout)
        except EtcdError:
            self.renewal_failures += 1
            self._next_keepalive = t_send + min(0.1, self.cfg.keepalive_s)
            raise
        if ttl <= 0:
            log.warning("election %s: lease %x is gone", self.me.instance_id, self._lease)
            self._lease = 0
            if st.role is not Role.FOLLOWER:
                self._publish(role=Role.FOLLOWER, lease_deadline=0.0)
            self._flags.leader_changed = True
            return
        self.renewals += 1
        self._renewed(t_send, ttl)
        if st.role is Role.FOLLOWER and self.renewals % 4 == 0:
            self._flags.leader_changed = True  # re-read the key now and then: a watch can lag
        if st.role is Role.LEADER:
            self._publish(lease_deadline=self._deadline)
        elif st.role is Role.FENCED:
            self._confirm_still_leader()

    def _confirm_still_leader(self) -> None:
        """Renewed after the deadline (etcd came back before our lease expired):
        lead again if the campaign key is still ours."""
        kv = self._etcd.get(self.keys.leader)
        st = self._state
        if kv is not None and kv.create_revision == st.epoch and kv.lease == self._lease:
            log.info("election %s: lease confirmed again; leading epoch %d",
                     self.me.instance_id, st.epoch)
            self._publish(role=Role.LEADER, lease_deadline=self._deadline)
        else:
            self._publish(role=Role.FOLLOWER, lease_deadline=0.0)
            self._flags.leader_changed = True

    def _follow(self) -> None:
        """Re-read the campaign key; step down if it is no longer ours."""
        assert self._resolver is not None
        leader = self._resolver.refresh()
        st = self._state
        if st.role is not Role.FOLLOWER:
            if leader is not None and leader.epoch == st.epoch:
                return
            log.warning("election %s: campaign key of epoch %d gone or replaced",
                        self.me.instance_id, st.epoch)
            self._publish(role=Role.FOLLOWER, lease_deadline=0.0, leader=leader,
                          epoch=leader.epoch if leader else st.epoch)
            return
        if leader is not None and leader.instance_id == self.me.instance_id \
                and leader.epoch != st.epoch:
            # a key left by an earlier run of this instance: it expires with its lease
            self._publish(leader=None)
            self._next_keepalive = min(self._next_keepalive, fence_clock() + 0.25)
            return
        self._publish(leader=leader, epoch=leader.epoch if leader else st.epoch)

    def _campaign(self) -> None:
        kv = self._etcd.get(self.keys.sync)
        sync = SyncSet.decode(kv.value, kv.mod_revision) if kv is not None else SyncSet()
        eligible = sync.eligible(self.me.instance_id)
        # listed as a member (by an earlier run of this process, or before a
        # resync began) yet not holding that state now: the listing is stale
        stale = eligible and sync.revision != 0 and not sync.any_eligible \
            and sync.leader != self.me.instance_id and not self.member_ready()
        eligible = eligible and not stale
        self._publish(eligible=eligible)
        if not eligible:
            if not self._logged_ineligible:
                self._logged_ineligible = True
                log.info("election %s: %s the in-sync set %s of epoch %d: not campaigning",
                         self.me.instance_id, "not caught up with" if stale else "not in",
                         list(sync.members), sync.epoch)
            return
        self._logged_ineligible = False
        sync_guard = (Compare(self.keys.sync, CompareTarget.MOD, "=", sync.revision)
                      if sync.revision else
                      Compare(self.keys.sync, CompareTarget.CREATE, "=", 0))
        info = LeaderInfo(self.me.instance_id, self.me.address, self.me.replication,
                          self.me.metrics)
        self.campaigns += 1
        r = self._etcd.txn([Compare(self.keys.leader, CompareTarget.CREATE, "=", 0), sync_guard],
                           [PutOp(self.keys.leader, info.encode(), self._lease)],
                           [RangeOp(self.keys.leader)])
        if r.succeeded:
            self._publish(role=Role.LEADER, epoch=r.revision,
                          leader=replace(info, epoch=r.revision), lease_deadline=self._deadline)
            return
        kvs = r.ranges[0] if r.ranges else []
        if kvs:
            try:
                leader = LeaderInfo.decode(kvs[0].value, kvs[0].create_revision)
            except ValueError:
                return
            self._publish(leader=leader, epoch=leader.epoch)
        # else the sync set changed under us: the next step reads it again


def _write_sync_set(etcd: EtcdClient, leader_key: str, sync_key: str, instance_id: str,
                    epoch: int, members: tuple[str, ...], any_eligible: bool) -> None:
    """The txn that changes the in-sync set: applied only while the campaign
    key is the one of ``epoch`` (NOT_LEADER otherwise)."""
    value = SyncSet(instance_id, epoch, tuple(members), any_eligible).encode()
    r = etcd.txn([Compare(leader_key, CompareTarget.CREATE, "=", epoch)],
                 [PutOp(sync_key, value)])
    if not r.succeeded:
        raise KVPoolError(f"lost leadership of epoch {epoch}", ErrorCode.NOT_LEADER)


@dataclass(frozen=True)
class SyncWrite:
    """The outcome of one write of the in-sync set. A failed write may still
    have been applied (etcd got it, its answer did not arrive in time)."""

    epoch: int
    members: frozenset[str]
    ok: bool
    error: str = ""


class SyncWriter:
    """Writes the leader's in-sync set to etcd on its own thread, with its own
    etcd client: an unreachable or slow etcd never stalls the caller (the
    master's loop) and never waits behind the elector's renewals, nor delays
    them.

    One write at a time: :meth:`submit` returns False while a write is in
    flight or its outcome has not been taken with :meth:`result`. Each write
    is the txn guarded by the campaign key of the epoch it was submitted for,
    so a write of a term that ended is never applied.
    """

    def __init__(self, cfg: ElectionConfig, instance_id: str) -> None:
        self._etcd = EtcdClient(cfg.endpoints, cfg.etcd_timeout_s)
        self._keys = group_keys(cfg.cluster_id)
        self._me = instance_id
        self._cv = threading.Condition()
        self._job: tuple[int, frozenset[str], bool] | None = None
        self._result: SyncWrite | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A write is in flight or its outcome was not taken yet."""
        return self._job is not None or self._result is not None

    def submit(self, epoch: int, members: frozenset[str], any_eligible: bool) -> bool:
        """Start writing ``members`` as the in-sync set of ``epoch``; False
        (nothing started) while :attr:`busy` or closed."""
        with self._cv:
            if self._closed or self.busy:
                return False
            self._job = (epoch, members, any_eligible)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-sync-writer",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def result(self) -> SyncWrite | None:
        """The outcome of the last write, once (None while none is new)."""
        if self._result is None:  # the loop's common case: no lock taken
            return None
        with self._cv:
            res, self._result = self._result, None
        return res

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(5)
        self._etcd.close()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                epoch, members, any_eligible = self._job  # type: ignore[misc]
            try:
                _write_sync_set(self._etcd, self._keys.leader, self._keys.sync, self._me, epoch,
                                tuple(sorted(members)), any_eligible)
                res = SyncWrite(epoch, members, True)
            except Exception as exc:  # EtcdError, NOT_LEADER, or a bug: reported the same
                res = SyncWrite(epoch, members, False, str(exc))
            with self._cv:
                self._result = res
                self._job = None

"""The leader's in-sync set: the standbys whose acks release replies.

The set is published in etcd (:class:`~.election.SyncWriter`, off the loop
thread: the loop never waits on etcd), so whoever wins the next election
holds every acknowledged change. While a write is in flight, or failed (a
timed-out txn may have been applied), etcd may hold any of the sets written
since the last confirmed one: replies wait for every standby of each
(``ReplicationSource.sync_members``, the union); those of the confirmed set
count toward ``sync_standbys``. A leader short of ``sync_standbys`` counted
members refuses writes before applying them (:attr:`InSyncSet.short`): at
once when too few standbys are connected to make up the count, else once
the set has been short for ``sync_timeout_s``.
"""

from __future__ import annotations

import logging
import time

from kvpool.master.ha.election import SyncWriter
from kvpool.master.ha.source import ReplicationSource

__all__ = ["InSyncSet"]

log = logging.getLogger(__name__)

_SYNC_RETRY_S = 0.1  # after a failed write of the in-sync set, the next one waits this long


class InSyncSet:
    """A leader's in-sync set in its term (see the module docstring)."""

    def __init__(self, writer: SyncWriter, instance_id: str, want: int,
                 timeout_s: float) -> None:
        self.writer = writer
        self.instance_id = instance_id
        self.want = want  # sync_standbys
        self.timeout_s = timeout_s  # sync_timeout_s
        self._next_join_wait = 0.0
        self.reset(0)

    def reset(self, epoch: int) -> None:
        """A new term of ``epoch`` begins: nothing confirmed, the set empty
        (standbys join) and short from now."""
        self.epoch = epoch
        #: the set of this term's last write that succeeded (None: none yet)
        self.confirmed: frozenset[str] | None = None
        #: sets written since whose outcome is unknown (in flight, failed)
        self.uncertain: list[frozenset[str]] = []
        self.count = 0  # members counted toward sync_standbys
        self._counted: frozenset[str] = frozenset()
        self._next_write = 0.0
        # since when the set is short of sync_standbys (0: it is not); short for
        # sync_timeout_s -> writes are refused, not held
        self._short_since = self._term_start = time.monotonic()
        self.short = False

    def track(self, now: float, connected: int) -> None:
        """Is the set short of ``sync_standbys`` (writes refused)? Once it has
        been short for ``sync_timeout_s`` (a new term's standbys join, a
        connected standby catches up to replace a lost member); at once when
        it is short and fewer than ``sync_standbys`` standbys are even
        ``connected`` (past a new term's first ``sync_timeout_s``): none can
        join soon, so a write would only be applied and never acknowledged."""
        if self.count >= self.want:
            self._short_since = 0.0
            self.short = False
            return
        if not self._short_since:
            self._short_since = now
        self.short = now - self._short_since >= self.timeout_s or (
            connected < self.want and now - self._term_start >= self.timeout_s)

    def maintain(self, src: ReplicationSource) -> None:
        """Start the write of the set this leader wants, if it differs from
        what etcd may hold: without the standbys that lag, plus caught-up
        ones while it is short. Never waits on etcd."""
        if self.writer.busy or time.monotonic() < self._next_write:
            return
        target = set(src.sync_members) - set(src.lagging(self.timeout_s))
        if len(target) < self.want:
            candidates = [sid for sid, sb in src.standbys.items()
                          if sid not in src.sync_members
                          and sb.status.state.value == "streaming"]
            if candidates:
                target.update(self._caught_up(src)[:self.want - len(target)])
        want = frozenset(target)
        if want != self.confirmed or self.uncertain:
            self.submit(src, want)

    def _caught_up(self, src: ReplicationSource) -> list[str]:
        caught = src.caught_up()
        if not caught and time.monotonic() >= self._next_join_wait:
            self._next_join_wait = time.monotonic() + 0.5  # at most 10 % of the loop
            src.flush_lazy()  # what it was not sent yet, it cannot ack
            # under load a standby is always one batch behind: give it a moment
            # with no new batches (bounded) so it can be seen holding everything
            deadline = time.monotonic() + 0.05
            while not caught and time.monotonic() < deadline:
                if src.wait(5):
                    src.poll()
                caught = src.caught_up()
        return caught

    def submit(self, src: ReplicationSource | None, members: frozenset[str]) -> None:
        """Write ``members`` as the in-sync set (in the background). From now on
        until a later write succeeds, replies also wait for the standbys it
        adds: etcd may list them as soon as the txn reaches it."""
        if src is None or not self.writer.submit(self.epoch, members, self.want <= 0):
            return
        if members not in self.uncertain:  # retries while etcd is away: listed once
            self.uncertain.append(members)
        self.reconcile(src)

    def written(self, src: ReplicationSource) -> None:
        """Take the outcome of the write in flight (if it finished)."""
        res = self.writer.result()
        if res is None or res.epoch != self.epoch:
            return  # still writing, or a write of an earlier term (never applied)
        if res.ok:
            before = self.confirmed or frozenset()
            for sid in sorted(before - res.members):
                log.warning("%s: standby %s dropped from the in-sync set", self.instance_id,
                            sid)
            for sid in sorted(res.members - before):
                log.info("%s: standby %s joined the in-sync set", self.instance_id, sid)
            self.confirmed = res.members
            self.uncertain = []
        else:
            # it may have been applied: its set stays among the possible ones
            log.warning("%s: cannot publish the in-sync set %s: %s", self.instance_id,
                        sorted(res.members), res.error)
            self._next_write = time.monotonic() + _SYNC_RETRY_S
        self.reconcile(src)

    def reconcile(self, src: ReplicationSource) -> None:
        """``src.sync_members`` (whose acks replies wait for) := every standby
        of a set etcd may hold. Those of the last confirmed set count toward
        sync_standbys: a standby being added counts once etcd took it; one
        whose removal is pending or failed counts (and is waited for) until
        a removal succeeded, as it holds everything acknowledged meanwhile."""
        confirmed = self.confirmed or frozenset()
        waited = set(confirmed)
        for members in self.uncertain:
            waited |= members
        for sid in waited - src.sync_members:
            src.add_sync(sid)
        for sid in src.sync_members - waited:
            src.remove_sync(sid)
        self.count = len(confirmed)
        self._counted = confirmed
        self.flag(src)

    def flag(self, src: ReplicationSource) -> None:
        """A standby reports ``in_sync`` only once etcd surely lists it."""
        counted = self._counted
        for sid, sb in src.standbys.items():
            sb.status.in_sync = sid in counted

"""Client liveness: busy is not dead.

A client that has not called for ``client_ttl_s`` becomes *suspect*: its
segments take no new placements but keep their objects, and it is ACTIVE
again with all of them at its next ping. Its objects go only when its
memory is really gone: an unmount (its close(), or its guard process / a
same-host janitor that saw it die), or silence of the client *and* its
guard for ``client_ttl_s + client_grace_s``. The guard
(``kvpool.store.guard``) heartbeats for a stalled process (GIL held,
SIGSTOP), so a live process's segments are never dropped; a frozen host or
cgroup (guard frozen too) is covered by the grace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.master.config import MasterConfig
from kvpool.master.segments import SegmentTable, SegState

if TYPE_CHECKING:
    from kvpool.master.directory import Directory

__all__ = ["Liveness"]

log = logging.getLogger(__name__)

_ACTIVE = SegState.ACTIVE
_SUSPECT = SegState.SUSPECT


class Liveness:
    """When each client and its guard were last heard, and who is suspect."""

    def __init__(self, cfg: MasterConfig, clock: Callable[[], float], segtab: SegmentTable,
                 directory: Directory) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segtab = segtab
        self.directory = directory  # drops segments; the tier hooks' argument
        #: client id -> last time the client process itself called (ping or any op)
        self.clients: dict[str, float] = {}
        #: client id -> last heartbeat of its guard process (its memory is alive)
        self.heartbeats: dict[str, float] = {}
        #: client id -> since when it is suspect (silent for client_ttl)
        self.suspects: dict[str, float] = {}
        self.expired_clients = 0  # dropped: silent past client_ttl + grace, or no segments
        self.suspected_clients = 0  # times a client became suspect
        self.revived_clients = 0  # times a suspect client came back with its segments

    def touch(self, client_id: str) -> None:
        """``client_id`` itself called now."""
        self.clients[client_id] = self.clock()

    def ping(self, client_id: str) -> tuple[bool, list[str]]:
        """The client process itself is alive and running: record it, make its
        suspect segments ACTIVE again (with their objects) and revive its
        segments awaiting it after a restart. Return (remount, segment_ids)."""
        known = client_id in self.clients
        self.clients[client_id] = self.clock()
        if client_id in self.suspects:
            self._revive(client_id)
        segtab = self.segtab
        segtab.owner_back(client_id)
        ids = sorted(segtab.client_segments.get(client_id, ()))
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
        segtab = self.segtab
        waiting = segtab.awaiting.pop(client_id, None)
        if not waiting:
            return False
        self.heartbeats[client_id] = now
        self.clients[client_id] = segtab.restored_at  # not heard from since the restart
        self.suspects[client_id] = now
        self.suspected_clients += 1
        for sid in sorted(waiting):
            seg = segtab.segments[sid]
            seg.state = _SUSPECT
            segtab.client_segments.setdefault(seg.owner, set()).add(seg.id)
        log.warning("client %s: only its guard answers since the restart; %d segment(s) "
                    "suspect", client_id, len(waiting))
        return True

    def _revive(self, client_id: str) -> None:
        since = self.suspects.pop(client_id)
        segtab = self.segtab
        n = 0
        for sid in sorted(segtab.client_segments.get(client_id, ())):
            seg = segtab.segments[sid]
            if seg.state == _SUSPECT:
                segtab.activate(seg)
                n += 1
        self.revived_clients += 1
        log.warning("client %s is back after %.1fs: %d segment(s) active again with their "
                    "objects", client_id, self.clock() - since, n)

    def _forget(self, client_id: str) -> None:
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
          (a FILE segment may be kept by the tier hooks).
        - Restored segments whose owner has not come back by the segment
          table's ``awaiting_deadline`` are dropped likewise.

        Return how many segments were dropped."""
        now = self.clock()
        ttl = self.cfg.client_ttl_s
        limit = ttl + self.cfg.client_grace_s
        budget = self.cfg.expiry_slice
        work = 0
        dropped = 0
        segtab = self.segtab
        segments = segtab.segments
        owners = segtab.client_segments
        d = self.directory
        for client_id in [c for c, t in self.clients.items() if now - t > ttl]:
            owned = owners.get(client_id)
            if not owned:  # nothing to keep for it (e.g. a pure client)
                self._forget(client_id)
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
                    segtab.suspend(seg)
                    work += 1
        for client_id in list(self.suspects):
            last = max(self.clients.get(client_id, 0.0), self.heartbeats.get(client_id, 0.0))
            if now - last <= limit:
                continue
            owned = owners.get(client_id)
            for sid in sorted(owned or ())[:budget - work]:
                seg = segments[sid]
                if not d.hooks.on_owner_lost(d, seg):  # the SSD tier keeps files
                    d.drop_segment(seg, f"client {client_id} silent for {now - last:.1f}s")
                dropped += 1
                work += 1
            if owners.get(client_id):
                return dropped  # budget spent; the rest next time
            self._forget(client_id)
            log.warning("client %s dropped: no ping or heartbeat for %.1fs", client_id,
                        now - last)
        if segtab.awaiting and now > segtab.awaiting_deadline:
            for owner in list(segtab.awaiting):
                for sid in list(segtab.awaiting.get(owner, ())):
                    if work >= budget:
                        return dropped
                    seg = segments[sid]
                    if not d.hooks.on_owner_lost(d, seg):  # the SSD tier keeps files
                        d.drop_segment(seg, "owner did not return after restart")
                    dropped += 1
                    work += 1
        return dropped

    def stats(self) -> dict[str, int]:
        return {"clients": len(self.clients), "expired_clients": self.expired_clients,
                "suspect_clients": len(self.suspects),
                "suspected_clients": self.suspected_clients,
                "revived_clients": self.revived_clients}

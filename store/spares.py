"""Spare allocations: space the master placed ahead for this client's next puts.

A commit (PUT_END, BATCH_PUT_END, PUT_COMMIT, BATCH_PUT_COMMIT) may ask the
master for *spare allocations* of the size just put: pending puts under
placeholder keys, placed and granted (the wire calls them reservations).
The next put of that size and at most as many keys writes into them and names
its keys with one PUT_COMMIT / BATCH_PUT_COMMIT: two round trips instead of
three. A :class:`SpareCache` holds them per size, a few groups per size and a
few sizes, the size granted least recently given back first. A spare is used
once (taken out of the cache before the write), only before its deadline and
in the master term that granted it; whatever goes wrong with one, the put is
done from the start as if there had been none. ``close()`` gives every spare
back (best effort: a client that dies has them released with its other puts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import msgspec

from kvpool.core.protocol import BatchPutRevoke, ReplicaDescriptor
from kvpool.store.session import MasterSession

__all__ = ["HELD_FACTOR", "Spare", "SpareCache"]

log = logging.getLogger(__name__)

#: the spares a client holds stay below this many times ``ClientConfig.reserve_max_bytes``
HELD_FACTOR = 4
_MAX_SIZES = 8  # sizes held at most
_PER_SIZE = 4  # groups held per size (threads putting the same size at once each find one)
_CLOSE_TIMEOUT_S = 0.5


class Spare(msgspec.Struct):
    """A group of spare allocations of one size: ``placeholders[i]`` is to be
    written at ``replicas[i]`` (one memory replica each; ``caps`` are the
    WRITE tokens they point at) before ``deadline`` (monotonic), in master
    term ``term``."""

    placeholders: list[str]
    replicas: list[ReplicaDescriptor]
    caps: list[bytes]
    deadline: float
    term: int

    def split(self, n: int) -> tuple[Spare, Spare]:
        """The first ``n`` allocations and the rest, as two groups."""
        return (Spare(self.placeholders[:n], self.replicas[:n], self.caps, self.deadline,
                      self.term),
                Spare(self.placeholders[n:], self.replicas[n:], self.caps, self.deadline,
                      self.term))


class SpareCache:
    """The spare allocations of one client, by value size (module docstring)."""

    def __init__(self, session: MasterSession, max_bytes: int) -> None:
        self.session = session
        self.max_bytes = max_bytes  # the largest put that asks for spares
        self.by_size: OrderedDict[int, list[Spare]] = OrderedDict()
        self.held_bytes = 0  # of every group held (a taken one no longer counts)
        self._lock = threading.Lock()

    def may_ask(self, size: int, n: int) -> bool:
        """Whether a put of ``n`` values of ``size`` bytes may ask its commit for
        spares: it is at most ``max_bytes``, and what is held stays below
        ``HELD_FACTOR`` times that with them."""
        want = size * n
        return want <= self.max_bytes and self.held_bytes + want <= HELD_FACTOR * self.max_bytes

    def keep(self, size: int, placeholders: list[str], replicas: list[ReplicaDescriptor],
             caps: list[bytes], ttl_ms: int, term: int) -> None:
        """Hold a commit reply's spares for values of ``size`` bytes; what
        does not fit is given back."""
        if not placeholders:
            return
        self._hold(size, Spare(placeholders, replicas, caps,
                               time.monotonic() + ttl_ms / 1000.0, term))

    def _hold(self, size: int, spare: Spare) -> None:
        drop: list[Spare] = []
        with self._lock:
            held = self.by_size.pop(size, None) or []
            if len(held) < _PER_SIZE:
                held.append(spare)
                self.held_bytes += size * len(spare.placeholders)
            else:
                drop.append(spare)
            self.by_size[size] = held  # the most recent size last
            while len(self.by_size) > _MAX_SIZES:
                old_size, groups = self.by_size.popitem(last=False)
                self.held_bytes -= old_size * sum(len(g.placeholders) for g in groups)
                drop += groups
        if drop:
            self.give_back([p for d in drop for p in d.placeholders])

    def put_back(self, size: int, spare: Spare) -> None:
        """Return a taken group that is still reserved at the master (its key
        existed already): usable for another put."""
        self._hold(size, spare)

    def take(self, size: int, n: int) -> Spare | None:
        """``n`` spares for values of ``size`` bytes, taken (no other put may
        use them; the rest of their group stays held); None when no group of
        at least ``n`` is still usable (an expired one is given back). The
        group is the smallest that holds ``n``, the newest of those (the
        longest ttl left): a single put does not split the group a batch of
        that size was granted while its own group of one is held."""
        if not self.by_size:
            return None
        with self._lock:
            held = self.by_size.get(size)
            if not held:
                return None
            at = len(held) - 1
            if len(held[at].placeholders) != n:  # (the newest fits exactly: the common case)
                best = 0
                for j in range(at, -1, -1):
                    have = len(held[j].placeholders)
                    if have >= n and (not best or have < best):
                        at, best = j, have
                if not best:
                    return None
            spare = held.pop(at)
            if len(spare.placeholders) > n:
                spare, rest = spare.split(n)
                held.append(rest)
            elif not held:
                del self.by_size[size]
            self.held_bytes -= size * n
        if time.monotonic() >= spare.deadline or spare.term != self.session.term:
            self.give_back(spare.placeholders)
            return None
        return spare

    def give_back(self, placeholders: list[str]) -> None:
        """PUT_REVOKE spares (one the master swept already answers
        OBJECT_NOT_FOUND, which is fine)."""
        self.session.revoke(placeholders, quiet=True)

    def close(self) -> None:
        """Give every spare back (best effort, a short timeout)."""
        with self._lock:
            held = [p for group in self.by_size.values() for s in group for p in s.placeholders]
            self.by_size.clear()
            self.held_bytes = 0
        if not held or not self.session.started or self.session.closed:
            return
        try:
            self.session.call_quick(BatchPutRevoke(self.session.client_id, held),
                                    _CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing regardless
            log.debug("giving back %d spare allocations at close: %s", len(held), exc)

"""Pipelined reads, and keys located in one process for another.

vLLM's connector loads a prefix layer group by layer group: the first group
is waited for before the model runs, the others while it runs.
:meth:`Pipelined.read` reads a batch in *stages* (lists of key indices), one
read loop (:meth:`kvpool.store.reads.Reads.read`) per stage, and calls
``on_stage(p, results)`` after stage p so the caller can use it while later
stages still move. Stage 0's keys are located first, by a call of their own
(or not at all: a :class:`Located` handed over from the scheduler process
answers them), the others by a second call sent at once from a helper thread,
answered while stage 0 moves (``ClientConfig.split_first_locate``; off: one
call for all).

:meth:`Pipelined.locate` keeps a locate's reply whole (:class:`Located`), so
another process of this host can read from it without asking again, and
:meth:`Pipelined.replica_locations` says where each key's replicas are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import BatchGetReplicaListReply
from kvpool.store._bufutil import buffer_nbytes
from kvpool.store.errors import StoreError
from kvpool.store.located import Located, Location, boot_id
from kvpool.store.reads import Reads, valid_key
from kvpool.store.replicas import ReplicaLocation, nearest_first, replica_location

__all__ = ["LOCATED_MIN_LEFT_S", "Pipelined"]

log = logging.getLogger(__name__)

#: a Located is used for stage 0 only with at least this much of its read lease
#: left, or half the lease where that is shorter (else stage 0 is located anew)
LOCATED_MIN_LEFT_S = 2.0
_UNREAD = int(ErrorCode.INTERNAL_ERROR)  # located, not read


class Pipelined:
    """Pipelined reads and cross-process locating of one client (module docstring)."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self.session = reads.session

    # ------------------------------------------------------------------ locating

    def locate(self, keys: Sequence[str]) -> Located:
        """One locate of ``keys`` (grants read leases), kept whole."""
        self.session.check()
        for k in keys:
            if not valid_key(k):
                raise StoreError(f"invalid key {k!r}", ErrorCode.INVALID_KEY)
        if not keys:
            return Located([], BatchGetReplicaListReply([], [], [], 0), float("inf"), boot_id())
        res, deadline = self.session.locate(list(keys))
        if res.segments:
            self.reads.registry.learn(res.segments)
        return Located(list(keys), res, deadline, boot_id())

    def replica_locations(self, located: Located) -> list[list[ReplicaLocation] | None]:
        """Per key of ``located``: its complete replicas, nearest first (the
        order reads try them), or None where it is missing."""
        res = located.reply
        registry = self.reads.registry
        out: list[list[ReplicaLocation] | None] = []
        for pos, code in enumerate(res.codes):
            if code != ErrorCode.OK:
                out.append(None)
                continue
            size = res.sizes[pos]
            out.append([replica_location(registry, r, size)
                        for r in nearest_first(registry, res.replicas[pos])] or None)
        return out

    # ------------------------------------------------------------------ stages

    def read(self, keys: Sequence[str], buffers: Sequence[Any],
             stages: Sequence[Sequence[int]], on_stage: Callable[[int, list[int]], None],
             located: Located | None = None) -> list[int]:
        """Read ``keys`` into ``buffers`` stage by stage (see
        Client.batch_get_into_parts); per key the bytes read or a negative
        code. Indices in no stage are located, not read."""
        self.session.check()
        if len(keys) != len(buffers):
            raise StoreError(f"{len(keys)} keys but {len(buffers)} buffers",
                             ErrorCode.INVALID_PARAMS)
        n = len(keys)
        results = [_UNREAD] * n
        valid = []
        for i in range(n):
            if valid_key(keys[i]):
                valid.append(i)
            else:
                results[i] = int(ErrorCode.INVALID_KEY)
        if not valid:
            return results
        ok = set(valid)
        first = list(dict.fromkeys(i for i in stages[0] if i in ok)) if stages else []
        in_first = set(first)
        rest = list(dict.fromkeys(i for st in stages[1:] for i in st
                                  if i in ok and i not in in_first))
        placed = in_first.union(rest)
        rest += [i for i in valid if i not in placed]  # located, not read
        if not self.reads.config.split_first_locate:
            first, rest = first + rest, []
        locs: dict[int, Location] = {}
        if first and located is not None and located.usable(
                min(LOCATED_MIN_LEFT_S, located.reply.lease_ttl_ms / 2000)):
            at = located.positions()
            if all(keys[i] in at for i in first):
                self._found(locs, first, located.reply, located.deadline,
                            [at[keys[i]] for i in first])
                first = []  # located: no call for them
        if first:
            res, deadline = self.session.locate([keys[i] for i in first])
            self._found(locs, first, res, deadline, None)
        helper: Future[tuple[BatchGetReplicaListReply, float]] | None = None
        if rest:
            helper = self.session.locate_later([keys[i] for i in rest])
        rest_code = 0
        for p, stage in enumerate(stages):
            if p >= 1 and helper is not None:
                rest_code = self._collect(helper, locs, rest)
                helper = None
            todo = [i for i in stage if i in ok and results[i] == _UNREAD
                    and (p == 0 or i not in in_first)]
            read: list[int] = []
            for i in todo:
                loc = locs.get(i)
                if loc is None:  # the second call failed
                    results[i] = rest_code or _UNREAD
                elif loc.code:
                    results[i] = int(loc.code)
                elif buffer_nbytes(buffers[i]) < loc.size:
                    results[i] = int(ErrorCode.BUFFER_OVERFLOW)
                else:
                    read.append(i)
            if read:
                got = self.reads.read([locs[i] for i in read], [buffers[i] for i in read],
                                      verify=True)
                for i, r in zip(read, got, strict=True):
                    results[i] = r
            on_stage(p, [results[i] for i in stage])
        if helper is not None:  # one stage only: the rest are just located
            self._collect(helper, locs, rest)
        for i in rest:
            loc = locs.get(i)
            if loc is not None and loc.code and i not in placed:
                results[i] = int(loc.code)
        return results

    def _found(self, locs: dict[int, Location], idx: Sequence[int],
               res: BatchGetReplicaListReply, deadline: float,
               positions: Sequence[int] | None) -> None:
        for i, loc in zip(idx, self.reads.locations(res, deadline, positions), strict=True):
            locs[i] = loc

    def _collect(self, helper: Future[tuple[BatchGetReplicaListReply, float]],
                 locs: dict[int, Location], rest: list[int]) -> int:
        """The second call's answer into ``locs``; its code when it failed (0: none)."""
        try:
            res, deadline = helper.result()
        except KVPoolError as got:
            log.warning("locating %d key(s) for later stages failed: %s", len(rest), got)
            try:
                return int(ErrorCode(int(got.code)))
            except ValueError:
                return _UNREAD
        self._found(locs, rest, res, deadline, None)
        return 0

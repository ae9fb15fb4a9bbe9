"""A submitted batch: its requests' statuses and its sub-batches.

A :class:`BatchHandle` is what :meth:`kvpool.transfer.TransferEngine.submit`
returns. Each attempt of one transport on some of the batch's requests is a
:class:`SubBatch` with its own state (PENDING -> RUNNING -> DONE | FAILED),
counters and first error. A request's :class:`RequestStatus` is made when
it becomes terminal; the failover bookkeeping of a request (:class:`Track`:
transports tried, attempts, errors) is made only when it first fails, so a
batch whose requests all succeed at once costs no per-request state beyond
its final statuses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from enum import Enum

from kvpool.core.errors import ErrorCode
from kvpool.transfer.types import (
    RequestState,
    RequestStatus,
    TransferError,
    TransferRequest,
    done_status,
)

__all__ = ["BatchHandle", "SubBatch", "SubBatchState", "Track"]

_DONE, _FAILED = RequestState.DONE, RequestState.FAILED
_OK = ErrorCode.OK


class SubBatchState(Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # at least one of its requests failed on this transport


_PENDING = SubBatchState.PENDING
_NO_FAILURES: list[tuple[TransferRequest, TransferError]] = []  # shared: never appended to
_NO_INDICES: frozenset[int] = frozenset()


class SubBatch:
    """The requests of one batch that one transport serves in one attempt.

    It is also the transport's ``report(item, error)`` for its slices
    (exactly once per item; ``many(items)`` reports successes under one lock
    acquisition): a success finishes its request at once, a failure waits
    for the failover decision made when the sub-batch ends. A sub-batch
    made without a handle is a batch's first attempt on the caller's
    thread: it only records what it is told (no lock: one thread) until
    :meth:`adopt` hands it to the handle the failover needs."""

    __slots__ = ("done", "error", "failed", "failed_idx", "failures", "finished", "handle", "id",
                 "items", "ok", "slices_left", "started", "state", "transport")

    def __init__(self, handle: BatchHandle | None, id: int, transport: str,
                 items: list[TransferRequest]) -> None:
        self.handle = handle
        self.id = id
        self.transport = transport
        self.items = items
        self.state = _PENDING
        self.done = self.failed = 0
        self.error = ""
        self.started = self.finished = 0.0
        self.slices_left = 1
        # shared empty ones until the first failure (most sub-batches never fail)
        self.failures: list[tuple[TransferRequest, TransferError]] = _NO_FAILURES
        self.failed_idx: set[int] | frozenset[int] = _NO_INDICES
        self.ok: set[int] | None = None if handle is not None else set()  # an attempt's

    def fail(self, item: TransferRequest, err: TransferError) -> None:
        """Record ``item``'s failure (the caller checked it was not reported;
        the lock held when there is a handle)."""
        if self.failures is _NO_FAILURES:
            self.failures = []
            self.failed_idx = set()
        self.failed_idx.add(item.index)  # type: ignore[union-attr]
        self.failed += 1
        self.failures.append((item, err))

    def __call__(self, item: TransferRequest, err: TransferError | None) -> None:
        if err is None:
            self.many((item,))
            return
        idx = item.index
        handle = self.handle
        if handle is None:
            if idx not in self.failed_idx and idx not in self.ok:  # type: ignore[operator]
                self.fail(item, err)
            return
        with handle._lock:
            if idx in self.failed_idx or handle._status[idx] is not None:
                return  # reported already
            self.fail(item, err)

    def many(self, items: Sequence[TransferRequest]) -> None:
        """Report ``items`` done (those reported before are ignored)."""
        handle = self.handle
        if handle is None:
            ok = self.ok
            assert ok is not None
            before = len(ok)
            if self.failed_idx:
                ok.update([it.index for it in items if it.index not in self.failed_idx])
            elif len(items) == 1:  # (a transport that reports item by item)
                ok.add(items[0].index)
            else:
                ok.update([it.index for it in items])
            self.done += len(ok) - before
            return
        with handle._lock:
            if self.failed_idx:
                items = [it for it in items if it.index not in self.failed_idx]
            self.done += handle.finish_many_locked(items, self.transport)

    def adopt(self, handle: BatchHandle, id: int) -> None:
        """An attempt is handed to ``handle``: its successes are finished
        there, its failures wait for :meth:`BatchRunner._slice_done`."""
        self.handle = handle
        self.id = id
        handle.sub_batches.append(self)
        ok = self.ok
        if ok:
            with handle._lock:
                handle.finish_many_locked([it for it in self.items if it.index in ok],
                                          self.transport)
        self.ok = None

    def reported(self, item: TransferRequest) -> bool:
        """Whether ``item`` was reported (done or failed); the lock held."""
        assert self.handle is not None
        return self.handle._status[item.index] is not None or item.index in self.failed_idx


class Track:
    """A request's failover bookkeeping, made at its first failure:
    ``candidates`` (its rule's transports, shared and read only), ``tried``
    (every transport it was given to, in order), failed ``attempts`` per
    transport, ``failovers`` made, the ``errors`` of every failed attempt and
    the ``code`` of the last one."""

    __slots__ = ("attempts", "candidates", "code", "errors", "failovers", "tried")

    def __init__(self, candidates: Sequence[str], first: str) -> None:
        self.candidates = candidates
        self.tried: list[str] = [first]
        self.attempts: dict[str, int] = {}
        self.failovers = 0
        self.errors: list[str] = []
        self.code = _OK


class BatchHandle:
    """Handle of a submitted batch: :meth:`wait`, :meth:`status`, :attr:`ok`;
    ``sub_batches`` lists every sub-batch attempt (for inspection and tests).

    ``deadline`` (monotonic seconds, None: none) bounds every attempt of the
    batch, retries and failovers included. A caller that stops waiting calls
    :meth:`abandon`: nothing new starts, and it waits for the slices still
    running, so that no transport writes into the batch's buffers after the
    caller was told the batch is over."""

    __slots__ = ("_active", "_cond", "_lock", "_remaining", "_status", "_tracks", "abandoned",
                 "deadline", "sub_batches")

    def __init__(self, n: int, deadline: float | None = None) -> None:
        # entered directly on hot paths (a C-level context manager); the
        # condition on it is made only when someone has to wait
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None
        self._status: list[RequestStatus | None] = [None] * n  # None: not terminal yet
        self._tracks: dict[int, Track] = {}
        self._remaining = n
        self.sub_batches: list[SubBatch] = []
        self.deadline = deadline
        self.abandoned = False
        self._active = 0  # slices started and not yet ended (begin_slices/end_slice)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every request is DONE or FAILED; False on timeout."""
        with self._lock:
            if self._remaining == 0:  # a batch run on the caller's thread: finished already
                return True
            if self._cond is None:
                self._cond = threading.Condition(self._lock)
            return self._cond.wait_for(lambda: self._remaining == 0, timeout)

    def status(self) -> list[RequestStatus]:
        """A snapshot (copies) of every request's status, in request order."""
        with self._lock:
            running: dict[int, str] = {}
            for sb in self.sub_batches:
                for it in sb.items:
                    running[it.index] = sb.transport
            out = []
            for i, st in enumerate(self._status):
                if st is None:
                    t = self._tracks.get(i)
                    name = running.get(i)
                    st = RequestStatus(RequestState.RUNNING if name else RequestState.PENDING,
                                       name, t.code if t is not None else _OK,
                                       t.errors if t is not None else [])
                out.append(RequestStatus(st.state, st.transport, st.code, list(st.errors)))
            return out

    def statuses(self) -> list[RequestStatus]:
        """The terminal statuses (the batch is done: terminal statuses never change)."""
        with self._lock:
            return self._status  # type: ignore[return-value]

    @property
    def done(self) -> bool:
        with self._lock:
            return self._remaining == 0

    @property
    def ok(self) -> bool:
        with self._lock:
            return all(st is not None and st.state is _DONE for st in self._status)

    def abandon(self, grace_s: float) -> bool:
        """The caller stops waiting: no slice starts from now on, and this
        waits up to ``grace_s`` seconds for the running ones to end (each is
        bounded by :attr:`deadline`). False if some still ran then."""
        with self._lock:
            self.abandoned = True
            if self._active == 0:
                return True
            if self._cond is None:
                self._cond = threading.Condition(self._lock)
            return self._cond.wait_for(lambda: self._active == 0, grace_s)

    # -- engine side ------------------------------------------------------------
    def over(self) -> bool:
        """Whether the caller abandoned the batch or its deadline passed: no
        attempt of it may start."""
        deadline = self.deadline
        return self.abandoned or (deadline is not None and time.monotonic() >= deadline)

    def begin_slices(self, n: int) -> bool:
        """Count ``n`` slices about to start (or, for a first attempt run on
        the caller's thread, just run: its end is counted too); False
        (nothing counted) once the batch is abandoned: they must not start."""
        with self._lock:
            if self.abandoned:
                return False
            self._active += n
            return True

    def end_slice(self) -> None:
        """A slice counted by :meth:`begin_slices` has ended (its transport returned)."""
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._cond is not None:
                self._cond.notify_all()

    def track(self, idx: int, candidates: Sequence[str], first: str) -> Track:
        """Request ``idx``'s track, made on first use (its first transport
        ``first``); call with the lock held."""
        t = self._tracks.get(idx)
        if t is None:
            t = self._tracks[idx] = Track(candidates, first)
        return t

    def finish(self, idx: int, state: RequestState, transport: str | None,
               code: ErrorCode = _OK, error: str | None = None) -> None:
        with self._lock:
            self.finish_locked(idx, state, transport, code, error)

    def finish_locked(self, idx: int, state: RequestState, transport: str | None,
                      code: ErrorCode = _OK, error: str | None = None) -> None:
        """Make request ``idx`` terminal (once; later calls are ignored);
        its status lists the errors of its track and ``error``."""
        if self._status[idx] is not None:
            return
        t = self._tracks.get(idx)
        errors = t.errors if t is not None else []
        if error:
            errors.append(error)
        self._status[idx] = RequestStatus(state, transport, code, errors)
        self._remaining -= 1
        if self._remaining == 0 and self._cond is not None:
            self._cond.notify_all()

    def finish_many_locked(self, items: Sequence[TransferRequest], transport: str) -> int:
        """Requests ``items`` DONE on ``transport`` (the lock held; those
        terminal already are left as they are): how many were finished."""
        status = self._status
        tracks = self._tracks
        n = 0
        if not tracks:  # nothing failed before (the common case)
            done = done_status(transport)
            for it in items:
                idx = it.index
                if status[idx] is None:
                    status[idx] = done
                    n += 1
        else:
            for it in items:
                idx = it.index
                if status[idx] is not None:
                    continue
                t = tracks.get(idx)
                status[idx] = RequestStatus(_DONE, transport, _OK,
                                            t.errors if t is not None else [])
                n += 1
        self._remaining -= n
        if self._remaining == 0 and self._cond is not None:
            self._cond.notify_all()
        return n


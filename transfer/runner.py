"""The batch runner: resolve, group by transport, run, fail over.

One path for every batch. :meth:`BatchRunner.submit` resolves each request
(buffer, segment, bounds; requests alike in segment, device and length as an
earlier one of the batch are checked inline against what it resolved to),
asks the selector for its transport and groups the requests into one
sub-batch per transport. A sub-batch runs in slices on its transport's worker
pool (``threads`` slices in parallel when it is large), or on the calling
thread: a batch the caller waits for (:meth:`run`, :meth:`transfer`) that one
transport serves in one slice, and any slice of at most the transport's
``inline_max_bytes``. A request that fails retryably is retried on the same
transport (``retries``), then re-planned onto the next transport its rule
allows (up to ``max_failover``); every failed attempt counts towards the
transport's health (:mod:`kvpool.transfer.selection`). Requests that succeed
at once cost no bookkeeping beyond their final status (:mod:`kvpool.transfer.batch`).
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections.abc import Sequence
from typing import cast

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor
from kvpool.transfer.batch import BatchHandle, SubBatch, SubBatchState, Track
from kvpool.transfer.buffers import BufferHandle, as_buffer
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.gpu import copies_independent
from kvpool.transfer.registry import SegmentRegistry
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.selection import Transports, TransportSlot, peer_key
from kvpool.transfer.types import (
    RequestState,
    RequestStatus,
    TransferError,
    TransferOp,
    TransferRequest,
    done_status,
)

__all__ = ["BatchRunner"]

log = logging.getLogger(__name__)

_DONE, _FAILED = RequestState.DONE, RequestState.FAILED
_READ = TransferOp.READ
_OK = ErrorCode.OK
_LENGTH = operator.attrgetter("length")
# a request settled before it reaches a transport: (index, state, code, error)
_Early = tuple[int, RequestState, ErrorCode, str | None]
_NONE_EARLY: list[_Early] = []  # (shared, never appended to: see _settled)
_PENDING, _RUNNING = SubBatchState.PENDING, SubBatchState.RUNNING
#: a sub-batch is split across a transport's threads only in slices of at least this
#: many bytes (below it one thread finishes sooner than two threads start)
_MIN_SLICE_BYTES = 4 << 20
_TWO_SLICES = 2 * _MIN_SLICE_BYTES  # below it a sub-batch is one slice
# how long a caller that stopped waiting waits for its batch's running slices:
# they end at its deadline (every transport bounds its waits by it), so this
# only covers a thread that got the CPU late
_ABANDON_GRACE_S = 10.0



class BatchRunner:
    """Runs batches of :class:`TransferRequest` over ``transports`` (module docstring)."""

    def __init__(self, config: TransferConfig, registry: SegmentRegistry,
                 transports: Transports) -> None:
        self.config = config
        self.registry = registry
        self.transports = transports
        self.closed = False
        self._sb_ids = itertools.count(1)

    # -- the caller's entry points ------------------------------------------------
    def run(self, requests: Sequence[TransferRequest], timeout: float) -> list[RequestStatus]:
        """Run a batch and wait at most ``timeout`` seconds. Never raises for a
        slow batch: a request still unfinished then is reported FAILED with
        TIMEOUT (a reader moves on to another replica instead of waiting on a
        dead peer)."""
        deadline = time.monotonic() + timeout
        got = self._sync(requests, deadline)
        if type(got) is list:
            return got
        handle = cast(BatchHandle, got)
        if handle._remaining:
            handle.wait(max(0.0, deadline - time.monotonic()))
        if not handle._remaining:
            return handle._status  # type: ignore[return-value]  # all terminal, never changed
        self._abandon(handle)
        now = handle.status()
        return [st if st.state is _DONE or st.state is _FAILED else RequestStatus(
                    _FAILED, st.transport, ErrorCode.TIMEOUT,
                    [*st.errors, f"no answer within {timeout:.2f}s"]) for st in now]

    def transfer(self, requests: Sequence[TransferRequest],
                 timeout: float | None = None) -> list[RequestStatus]:
        """Run a batch and wait for it. Raises ``TransferError(TIMEOUT)`` if
        not every request is terminal within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        got = self._sync(requests, deadline)
        if type(got) is list:
            return got
        handle = cast(BatchHandle, got)
        finished = True
        if handle._remaining:
            finished = handle.wait(None if deadline is None
                                   else max(0.0, deadline - time.monotonic()))
        if deadline is not None and time.monotonic() >= deadline and not handle.ok:
            finished = False  # a slice on this thread was cut short by the deadline
        if not finished:
            self._abandon(handle)
            raise TransferError(f"batch of {len(requests)} not finished within {timeout}s",
                                ErrorCode.TIMEOUT)
        return handle.statuses()

    def submit(self, requests: Sequence[TransferRequest], sync: bool = False,
               deadline: float | None = None) -> BatchHandle:
        """Start a batch (``sync``: the caller waits for it, so a sub-batch of
        one slice runs on its thread). Invalid requests fail at once with
        their code; the others run in per-transport sub-batches."""
        groups, early = self._group(requests)
        handle = BatchHandle(len(requests), deadline)
        for i, state, code, error in early:
            handle.finish(i, state, None, code, error)
        self._launch(handle, groups, sync)
        return handle

    @staticmethod
    def _abandon(handle: BatchHandle) -> None:
        """The caller stops waiting for ``handle``: wait for its running
        slices to end (they are bounded by its deadline), so no bytes land in
        its buffers afterwards."""
        if not handle.abandon(_ABANDON_GRACE_S):
            log.error("a transport still ran a slice %.1fs after its batch's deadline; "
                      "its buffers may still be written", _ABANDON_GRACE_S)

    def _sync(self, requests: Sequence[TransferRequest], deadline: float | None
              ) -> list[RequestStatus] | BatchHandle:
        """A batch the caller waits for. One that one transport serves in one
        slice runs on this thread before any bookkeeping is made: its
        statuses when every request succeeded; else the batch handle, made
        then, to which the attempt is handed as the general path's first
        (the same retries, failover and health accounting). Any other batch:
        :meth:`submit`'s handle."""
        groups, early = self._group(requests)
        if len(groups) == 1 and not early:
            ((name, items),) = groups.items()
            slot = self.transports.slots[name]
            n = len(items)
            total = items[0].length if n == 1 else sum(map(_LENGTH, items))
            if total < _TWO_SLICES or _slices(slot, total, n) == 1:
                sb = SubBatch(None, 0, name, items)  # an attempt: no handle yet
                crash = self._execute(sb, slot, items, deadline)
                if crash is None and sb.done == n and not sb.failures:
                    if slot.health:  # a success towards a peer clears its failure count
                        self.transports.update_health(slot, sb, [])
                    return [done_status(name)] * n
                handle = BatchHandle(len(requests), deadline)
                sb.adopt(handle, next(self._sb_ids))
                handle.begin_slices(1)  # (ended by _slice_done, as a launched slice)
                self._slice_done(handle, sb, slot, items, crash)
                return handle
        handle = BatchHandle(len(requests), deadline)
        for i, state, code, error in early:
            handle.finish(i, state, None, code, error)
        self._launch(handle, groups, True)
        return handle

    def _group(self, requests: Sequence[TransferRequest]
               ) -> tuple[dict[str, list[TransferRequest]], list[_Early]]:
        """Resolve every request and group the valid ones by their first
        transport; the others as ``(index, state, code, error)`` (empty:
        DONE; invalid or without a transport: FAILED)."""
        if self.closed:
            raise TransferError("engine is closed", ErrorCode.CLOSED, retryable=False)
        if len(requests) == 1:  # nothing to group
            got = self._first(0, requests[0], copies_independent())
            return ({got: [requests[0]]}, _NONE_EARLY) if isinstance(got, str) else ({}, [got])
        groups: dict[str, list[TransferRequest]] = {}
        early: list[_Early] = _NONE_EARLY
        # (segment id, device, length) -> what the first such request resolved to:
        # later ones alike skip resolution and selection (the same checks, inline)
        alike: dict[tuple[str, str, int],
                    tuple[SegmentDescriptor, LocalSegment | None, bool, list[TransferRequest]]] = {}
        independent = copies_independent()
        for i, req in enumerate(requests):
            if alike and type(req) is TransferRequest and not req.transport:
                buf = req.buffer
                if type(buf) is not BufferHandle:
                    try:
                        buf = req.buffer = as_buffer(buf)
                    except Exception:  # resolved (and refused) below
                        buf = None
                length = req.length
                known = alike.get((req.segment_id, buf.device, length)) \
                    if buf is not None else None
                if known is not None:
                    desc, local, same_host, group = known
                    op, offset, boff = req.op, req.offset, req.buffer_offset
                    if type(offset) is int and type(boff) is int and type(op) is TransferOp \
                            and 0 <= offset and offset + length <= desc.size \
                            and 0 <= boff and boff + length <= buf.length \
                            and (op is not _READ or not buf.readonly):
                        if type(req.capability) is not bytes:
                            req.capability = bytes(req.capability or b"")
                        req.index = i
                        req.segment = desc
                        req.same_host = same_host
                        req.local = local
                        req.independent = independent
                        group.append(req)
                        continue
            name = self._first(i, req, independent)
            if not isinstance(name, str):
                early = _settled(early, name)
                continue
            grouped = groups.get(name)
            if grouped is None:
                grouped = groups[name] = []
            grouped.append(req)
            if not req.transport:
                alike[(req.segment_id, req.buffer.device, req.length)] = (
                    req.segment, req.local, req.same_host, grouped)
        return groups, early

    # -- resolution -------------------------------------------------------------
    def _first(self, i: int, req: TransferRequest, independent: bool) -> str | _Early:
        """Check request ``i``, fill in its resolved fields and pick its first
        transport: its name; or the request settled before any transport,
        as ``(index, state, code, error)``: an empty one DONE, an invalid
        one or one no transport can take FAILED (with the reason)."""
        try:
            if type(req) is not TransferRequest and not isinstance(req, TransferRequest):
                raise TransferError(f"request {i} is not a TransferRequest",
                                    ErrorCode.INVALID_PARAMS, retryable=False)
            op = req.op if type(req.op) is TransferOp else TransferOp(req.op)
            buf = req.buffer if type(req.buffer) is BufferHandle else as_buffer(req.buffer)
            sid = req.segment_id
            registry = self.registry
            desc = registry._descs.get(sid)  # (SegmentRegistry.resolve, without its frame)
            if desc is None:
                desc = registry.resolve(sid)[0]  # raises SEGMENT_NOT_FOUND
            offset, length, boff = req.offset, req.length, req.buffer_offset
            if not (type(offset) is int and type(length) is int and type(boff) is int) \
                    and not all(isinstance(x, int) for x in (offset, length, boff)):
                raise TransferError("offset/length must be integers", ErrorCode.INVALID_PARAMS,
                                    retryable=False)
            if offset < 0 or length < 0 or offset + length > desc.size:
                raise TransferError(
                    f"range [{offset}, {offset + length}) outside segment "
                    f"{sid!r} of {desc.size} bytes", ErrorCode.OUT_OF_BOUNDS, retryable=False)
            if boff < 0 or boff + length > buf.length:
                buf.check_range(boff, length)
            if op is _READ and buf.readonly:
                raise TransferError("READ into a read-only buffer", ErrorCode.INVALID_PARAMS,
                                    retryable=False)
            cap = req.capability
            req.op = op
            req.buffer = buf
            req.index = i
            req.segment = desc
            req.same_host = desc.host_id == registry.host_id
            req.local = registry._local.get(sid)
            req.capability = cap if type(cap) is bytes else bytes(cap or b"")
            req.independent = independent
            if length:
                return self.transports.first_choice(req)
            if req.transport:
                self.transports.candidates(req)  # an unknown one is still refused
            return (i, _DONE, _OK, None)
        except TransferError as exc:
            return (i, _FAILED, exc.code, str(exc))
        except Exception as exc:  # a bad buffer object etc.
            return (i, _FAILED, ErrorCode.INVALID_PARAMS, f"{type(exc).__name__}: {exc}")

    # -- running ----------------------------------------------------------------
    def _launch(self, handle: BatchHandle, groups: dict[str, list[TransferRequest]],
                sync: bool = False) -> None:
        """Start each group as a sub-batch on its transport, in slices; a
        batch abandoned by its caller (or past its deadline) starts nothing:
        its requests fail with TIMEOUT."""
        slots = self.transports.slots
        deadline = handle.deadline
        for name, items in groups.items():
            slot = slots[name]
            total = items[0].length if len(items) == 1 else sum(map(_LENGTH, items))
            n = _slices(slot, total, len(items))
            if n > 1:
                step = (len(items) + n - 1) // n
                slices = [items[k:k + step] for k in range(0, len(items), step)]
            else:
                slices = [items]
            if handle.over() or not handle.begin_slices(len(slices)):
                for it in items:
                    handle.finish(it.index, _FAILED, name, ErrorCode.TIMEOUT,
                                  f"{name}: not started: the batch's deadline passed")
                continue
            sb = SubBatch(handle, next(self._sb_ids), name, items)
            handle.sub_batches.append(sb)  # (list.append is atomic)
            sb.slices_left = len(slices)
            # no thread hop for one slice (the caller waits anyway, or the copy is tiny)
            inline = (sync and len(groups) == 1) or (
                n == 1 and total <= int(slot.settings.inline_max_bytes))
            for part in slices[:-1] if inline else slices:
                try:
                    slot.pool.submit(self._run_slice, handle, sb, slot, part, deadline)
                except RuntimeError as exc:  # pool shut down (engine closing)
                    self._slice_done(handle, sb, slot, part,
                                     TransferError(str(exc), ErrorCode.CLOSED, retryable=False))
            if inline:
                self._run_slice(handle, sb, slot, slices[-1], deadline)

    def _run_slice(self, handle: BatchHandle, sb: SubBatch, slot: TransportSlot,
                   part: list[TransferRequest], caller_deadline: float | None) -> None:
        if handle.abandoned:  # queued behind other work until its caller gave up
            crash: TransferError | None = TransferError(
                "not started: the caller stopped waiting", ErrorCode.TIMEOUT, retryable=False)
        else:
            crash = self._execute(sb, slot, part, caller_deadline)
        self._slice_done(handle, sb, slot, part, crash)

    @staticmethod
    def _execute(sb: SubBatch, slot: TransportSlot, part: list[TransferRequest],
                 caller_deadline: float | None) -> TransferError | None:
        """One slice on ``sb``'s transport, reporting to ``sb``; what it raised."""
        now = time.monotonic()
        if sb.state is _PENDING:  # (a benign race: any slice's start will do)
            sb.state = _RUNNING
            sb.started = now
        deadline = now + slot.settings.timeout_s
        if caller_deadline is not None and caller_deadline < deadline:
            deadline = caller_deadline
        try:
            slot.transport.execute(part, deadline, sb)
        except TransferError as exc:
            return exc
        except Exception as exc:
            log.exception("transport %s crashed on a sub-batch", sb.transport)
            return TransferError(f"{type(exc).__name__}: {exc}", ErrorCode.TRANSFER_FAIL)
        # the slice is recorded under its first request's op (a batch of the
        # store is of one op); failed requests count again in failures
        first = part[0]
        slot.made[first.op].record(
            len(part), first.length if len(part) == 1 else sum(map(_LENGTH, part)),
            time.monotonic() - now)
        return None

    def _slice_done(self, handle: BatchHandle, sb: SubBatch, slot: TransportSlot,
                    part: list[TransferRequest], crash: TransferError | None) -> None:
        """A slice's transport returned: settle its sub-batch when it was the
        last slice, retrying or failing over its failed requests while the
        batch's deadline allows; then the slice counts as ended."""
        try:
            self._settle(handle, sb, slot, part, crash)
        finally:
            handle.end_slice()

    def _settle(self, handle: BatchHandle, sb: SubBatch, slot: TransportSlot,
                part: list[TransferRequest], crash: TransferError | None) -> None:
        with handle._lock:
            failures: list[tuple[TransferRequest, TransferError]] = []
            if crash is None and not sb.failures and sb.slices_left == 1 \
                    and sb.done == len(sb.items):
                # the common case: the sub-batch's one slice, every request done
                sb.slices_left = 0
                sb.finished = time.monotonic()
                sb.state = SubBatchState.DONE
            else:
                for it in part:  # items the transport never reported
                    if sb.reported(it):
                        continue
                    sb.fail(it, crash or TransferError(
                        "transport returned without reporting the request",
                        ErrorCode.TRANSFER_FAIL))
                sb.slices_left -= 1
                if sb.slices_left > 0:
                    return
                sb.finished = time.monotonic()
                failures = list(sb.failures)
                sb.state = SubBatchState.FAILED if failures else SubBatchState.DONE
                if failures:
                    sb.error = str(failures[0][1])
        if failures or slot.health:
            self.transports.update_health(slot, sb, failures)
        if not failures:
            return
        groups: dict[str, list[TransferRequest]] = {}
        name = sb.transport
        self.transports.counters.failed(name, len(failures))
        # past the deadline (or given up by its caller) a batch starts no
        # attempt: a late one could write into buffers the caller reused
        over = handle.over()
        for item, err in failures:
            idx = item.index
            with handle._lock:
                track = handle._tracks.get(idx)
                if track is None:
                    track = handle.track(idx, self._candidates(item), name)
                track.errors.append(f"{name}: {err}")
                track.code = err.code
                track.attempts[name] = track.attempts.get(name, 0) + 1
            if not err.retryable or self.closed or over:
                handle.finish(idx, _FAILED, name, err.code)
                continue
            if track.attempts[name] <= slot.settings.retries \
                    and not slot.paused(peer_key(item)):
                groups.setdefault(name, []).append(item)
                continue
            if track.failovers >= self.config.max_failover:
                handle.finish(idx, _FAILED, name, err.code)
                continue
            before = len(track.tried)
            self._plan(handle, item, track, groups, err)
            if len(track.tried) > before:
                track.failovers += 1
                self.transports.counters.failed_over(name)
                log.info("request %d failed on %s (%s); failing over to %s", idx, name, err,
                         track.tried[-1])
        if groups:
            self._launch(handle, groups)

    def _candidates(self, item: TransferRequest) -> Sequence[str]:
        try:
            return self.transports.candidates(item)
        except TransferError:
            return ()

    def _plan(self, handle: BatchHandle, item: TransferRequest, track: Track,
              groups: dict[str, list[TransferRequest]], last_error: TransferError) -> None:
        """Put ``item`` into the group of its next transport, or fail it."""
        name, _why = self.transports.next_transport(item, track.candidates, track.tried)
        if name is None:
            handle.finish(item.index, _FAILED, track.tried[-1], last_error.code)
            return
        track.tried.append(name)
        groups.setdefault(name, []).append(item)


def _slices(slot: TransportSlot, total: int, count: int) -> int:
    """How many slices a sub-batch of ``count`` requests and ``total`` bytes
    is cut into: a second slice costs a thread hop, so only a large
    sub-batch gains from it."""
    if total < _TWO_SLICES:
        return 1
    return max(1, min(int(slot.settings.threads), count, total // _MIN_SLICE_BYTES))


def _settled(early: list[_Early], one: _Early) -> list[_Early]:
    """``early`` with ``one`` appended (a batch's own list made at its first)."""
    if early is _NONE_EARLY:
        early = []
    early.append(one)
    return early

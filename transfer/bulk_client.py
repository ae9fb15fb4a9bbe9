"""The requester's end of the bulk path: one blocking connection to a peer's
bulk port, moving runs of host-buffer READ/WRITE work items.

A run of items of one op is packed into requests whose headers stay below the
peer's limit (a per-batch capability token sent once per request, items
naming it by index, where the peer takes a table), every request is sent
before the first reply is read, and the payloads land straight in the callers'
buffers. A lone item takes the same request and checks without the packing
pass. Stream mechanics: :mod:`kvpool.transfer.bulk`.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvpool.core import spin as _spin
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer import wire
from kvpool.transfer.bulk import BulkStream, bulk_frame, set_congestion
from kvpool.transfer.transports.base import report_done
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["BulkClient"]

_MAX_ITEMS = 256  # ranges per request
_REPLY_MAX = 1 << 16  # largest reply header a client accepts
# a client polls for the reply to a small request (one request of at most
# _SPIN_BYTES of payload) for up to ``spin_s`` before it sleeps in recv: the reply
# to a small put or get comes soon after the request, and on a busy host waking
# a sleeping thread adds to that. The poll yields the CPU between tries (a late
# yield, on a busy CPU, stops the polls of the process for a while:
# core/spin.py), and a connection polls only while its small replies have of
# late come within the window (a moving average): later ones would only burn CPU
DEFAULT_SPIN_US = 150  # transports.tcp.options.reply_spin_us
_SPIN_BYTES = 64 << 10
_MV = "bulk_mv"  # BufferHandle.cache key of the buffer's byte memoryview (_bytes_view)


class BulkClient:
    """One blocking connection to a peer's bulk port (used by one thread at a time).

    ``max_header`` is the largest request header the peer takes (its
    :class:`~kvpool.transfer.wire.BulkOffer`); runs of ranges are packed into
    requests below it. ``caps_table``: the peer takes a request's capability
    table (each distinct token sent once per request, items name it by index).
    ``congestion``: the ``tcp_congestion`` policy (:func:`set_congestion`).
    ``spin_us``: how long it polls for the reply to a small request before
    sleeping (0: never).
    """

    def __init__(self, host: str, port: int, timeout: float, max_header: int = 4096,
                 caps_table: bool = False, congestion: str = "auto",
                 spin_us: float = DEFAULT_SPIN_US) -> None:
        sock = socket.create_connection((host, port), timeout=max(0.01, timeout))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_congestion(sock, congestion)
        self.stream = BulkStream(sock, _REPLY_MAX)
        self.broken = False
        self.max_header = max(256, max_header)
        self.caps_table = caps_table
        self.spin_s = spin_us / 1e6
        self._ids = itertools.count(1)
        self._reply_wait = 0.0  # seconds: see _run_group
        self._skipped = [0]  # lone waits not polled since the last probe (_run_single)
        self._ahead: tuple[Any, int | BaseException] | None = None  # see send_ahead

    def run(self, items: Sequence[Any], deadline: float, report: Callable[..., None],
            final_codes: set[ErrorCode], now: Callable[[], float]) -> None:
        """Execute host-buffer READ/WRITE work items, pipelined per run of one
        op (a mixed run could fill both directions' socket buffers at once).
        Reports each item. Marks the client broken on a stream error or timeout,
        failing what is left (retryable)."""
        if len(items) == 1 and not self.broken:
            self._run_single(items[0], deadline, report, final_codes)
            return
        for group in _runs(items):
            if self.broken:
                for it in group:
                    report(it, TransferError("bulk connection lost", ErrorCode.TRANSFER_FAIL))
                continue
            self._run_group(group, deadline, report, final_codes, now)

    def _pack(self, items: Sequence[Any]) -> list[list[Any]]:
        """Split one run into requests whose headers stay below ``max_header``
        (with a capability table, a token counts once per request)."""
        out: list[list[Any]] = []
        cur: list[Any] = []
        size = 32
        table = self.caps_table
        seen: set[bytes] = set()  # tokens already in the current request's table
        for it in items:
            cap = it.capability
            base = len(it.segment.segment_id) * 4 + 32
            if not table:
                est = base + len(cap)
            else:
                est = base + (len(cap) + 8 if cap not in seen else 0)
            if cur and (size + est > self.max_header or len(cur) >= _MAX_ITEMS):
                out.append(cur)
                cur, size = [], 32
                seen.clear()
                est = base + len(cap) + (8 if table else 0)
            cur.append(it)
            if table:
                seen.add(cap)
            size += est
        if cur:
            out.append(cur)
        return out

    def _header(self, rid: int, op: int, part: Sequence[Any]) -> wire.BulkRequest:
        """The request header of ``part`` (tokens by index when the peer takes a table)."""
        Item = wire.BulkItem
        if not self.caps_table:
            return wire.BulkRequest(rid, op, [
                Item(it.segment.segment_id, it.offset, it.length, it.capability)
                for it in part])
        caps: list[bytes] = []
        index: dict[bytes, int] = {}
        items = []
        for it in part:
            cap = it.capability
            if cap:
                k = index.get(cap)
                if k is None:
                    k = index[cap] = len(caps)
                    caps.append(cap)
                items.append(Item(it.segment.segment_id, it.offset, it.length, k))
            else:
                items.append(Item(it.segment.segment_id, it.offset, it.length))
        return wire.BulkRequest(rid, op, items, caps=caps)

    def _requests(self, items: Sequence[Any], op: int) -> list[tuple[Sequence[Any], int, bytes]]:
        """``(ranges, id, frame)`` of each request of one run: one request when
        its header fits (the common case: no packing pass), else :meth:`_pack`'s."""
        if self.caps_table and len(items) <= _MAX_ITEMS:
            rid = next(self._ids)
            frame = bulk_frame(self._header(rid, op, items))
            if len(frame) - wire.BULK_FRAME_HEADER <= self.max_header:
                return [(items, rid, frame)]
        out: list[tuple[Sequence[Any], int, bytes]] = []
        for part in self._pack(items):
            rid = next(self._ids)
            out.append((part, rid, bulk_frame(self._header(rid, op, part))))
        return out

    def _run_group(self, items: Sequence[Any], deadline: float, report: Callable[..., None],
                   final_codes: set[ErrorCode], now: Callable[[], float]) -> None:
        stream = self.stream
        write = items[0].op is TransferOp.WRITE
        done = 0  # items of ``items`` reported so far, in order
        try:
            reqs = self._requests(items, int(items[0].op))
            for part, _rid, frame in reqs:  # send every request, then read every reply
                views: list[Any] = [frame]
                if write:
                    for it in part:
                        n = it.length
                        if n:
                            off = it.buffer_offset
                            views.append(_bytes_view(it.buffer)[off:off + n])
                stream.write_views(views, deadline)
            sent = 0.0
            if len(reqs) == 1 and self.spin_s and \
                    sum(it.length for it in items) <= _SPIN_BYTES:
                sent = time.perf_counter()
                if self._reply_wait < self.spin_s:  # replies come within the window of late
                    stream.spin_until = sent + self.spin_s
            for part, rid, _ in reqs:
                raw = stream.read_frame(_REPLY_MAX, deadline)
                if sent:  # how long small replies take, of late: a moving average
                    # of waits capped at twice the window (one stall does not stop polls)
                    wait = min(time.perf_counter() - sent, 2 * self.spin_s)
                    self._reply_wait += (wait - self._reply_wait) * 0.125
                rep = wire.decode_bulk_reply(raw) if raw is not None else None
                if rep is None or rep.id != rid or len(rep.codes) != len(part):
                    raise ConnectionError("bulk reply out of step")
                codes = rep.codes  # ints; 0 is OK
                refused = any(codes)
                if not write:  # the payloads of the accepted ranges follow, in order
                    dst = [_bytes_view(it.buffer)[it.buffer_offset:it.buffer_offset + it.length]
                           for it, c in zip(part, codes, strict=True) if not c] \
                        if refused else \
                        [_bytes_view(it.buffer)[it.buffer_offset:it.buffer_offset + it.length]
                         for it in part]
                    if dst and not stream.read_into(dst, deadline):
                        raise ConnectionError("peer closed the bulk connection")
                if not refused:
                    done += len(part)
                    report_done(report, part)
                    continue
                for it, c in zip(part, codes, strict=True):
                    done += 1
                    if not c:
                        report(it, None)
                    else:
                        code = self._code(c)
                        report(it, TransferError(f"peer: {rep.err}", code,
                                                 retryable=code not in final_codes))
        except TimeoutError:
            self._fail(items[done:], report, "no reply before the deadline", ErrorCode.TIMEOUT)
        except (OSError, ConnectionError, KVPoolError, ValueError) as exc:
            self._fail(items[done:], report, f"bulk connection: {exc}", ErrorCode.TRANSFER_FAIL)

    def send_ahead(self, it: Any, deadline: float) -> None:
        """Send the request of the lone item ``it`` now; the next ``run([it])``
        reads its reply instead of sending it (the stripes of a large READ go
        out together from one thread, so the peer starts serving each at once
        rather than when the thread that receives it gets to run). A failure to
        send is reported by that ``run``, as it would have been there."""
        try:
            self._ahead = (it, self._send_single(it, deadline))
        except Exception as exc:  # raised again where run() would have met it
            self._ahead = (it, exc)

    def _send_single(self, it: Any, deadline: float) -> int:
        """Send the request (and a WRITE's payload) of one item; returns its id."""
        rid = next(self._ids)
        n = it.length
        cap = it.capability
        if self.caps_table and cap:
            req = wire.BulkRequest(rid, int(it.op),
                                   [wire.BulkItem(it.segment.segment_id, it.offset, n, 0)],
                                   caps=[cap])
        else:
            req = wire.BulkRequest(rid, int(it.op),
                                   [wire.BulkItem(it.segment.segment_id, it.offset, n, cap)])
        if it.op is TransferOp.WRITE and n:
            off = it.buffer_offset
            self.stream.write_views([bulk_frame(req), _bytes_view(it.buffer)[off:off + n]],
                                    deadline)
        else:
            self.stream.write_views([bulk_frame(req)], deadline)
        return rid

    def _run_single(self, it: Any, deadline: float, report: Callable[..., None],
                    final_codes: set[ErrorCode]) -> None:
        """:meth:`_run_group` of one item (a lone put or get): the same request,
        reply checks, reply poll and reports, without the packing pass and the
        per-item loops."""
        stream = self.stream
        n = it.length
        write = it.op is TransferOp.WRITE
        ahead, self._ahead = self._ahead, None
        try:
            if ahead is not None and ahead[0] is it:  # sent by send_ahead
                if isinstance(ahead[1], BaseException):
                    raise ahead[1]
                rid = ahead[1]
            else:
                rid = self._send_single(it, deadline)
            sent = 0.0
            polled = False
            if self.spin_s and n <= _SPIN_BYTES:
                sent = time.perf_counter()
                # see _run_group; a shut gate still polls now and then, and a
                # wait slept through counts as the window (core/spin.py)
                if _spin.polling() and (self._reply_wait < self.spin_s
                                        or _spin.probe(self._skipped, 0)):
                    polled = True
                    stream.spin_until = sent + self.spin_s
            raw = stream.read_frame(_REPLY_MAX, deadline)
            if sent:
                wait = _spin.wait_sample(time.perf_counter() - sent, polled, self.spin_s)
                self._reply_wait += (wait - self._reply_wait) * 0.125
            rep = wire.decode_bulk_reply(raw) if raw is not None else None
            if rep is None or rep.id != rid or len(rep.codes) != 1:
                raise ConnectionError("bulk reply out of step")
            c = rep.codes[0]
            if c:
                code = self._code(c)
                report(it, TransferError(f"peer: {rep.err}", code,
                                         retryable=code not in final_codes))
                return
            if not write and n:
                off = it.buffer_offset
                if not stream.read_into([_bytes_view(it.buffer)[off:off + n]], deadline):
                    raise ConnectionError("peer closed the bulk connection")
        except TimeoutError:
            self._fail([it], report, "no reply before the deadline", ErrorCode.TIMEOUT)
            return
        except (OSError, ConnectionError, KVPoolError, ValueError) as exc:
            self._fail([it], report, f"bulk connection: {exc}", ErrorCode.TRANSFER_FAIL)
            return
        report(it, None)

    @staticmethod
    def _code(code: int) -> ErrorCode:
        try:
            return ErrorCode(code)
        except ValueError:
            return ErrorCode.INTERNAL_ERROR

    def _fail(self, items: Sequence[Any], report: Callable[..., None], why: str,
              code: ErrorCode) -> None:
        self.broken = True
        for it in items:
            report(it, TransferError(why, code))

    def close(self) -> None:
        self.stream.close()


def _bytes_view(buf: Any) -> memoryview:
    """A byte memoryview of a host buffer, made once per buffer (kept in its
    ``cache``): slicing it is cheaper than a numpy view per range plus a cast."""
    mv = buf.cache.get(_MV)
    if mv is None:
        mv = buf.cache[_MV] = memoryview(buf.host_view()).cast("B")
    return cast(memoryview, mv)


def _runs(items: Sequence[Any]) -> list[Sequence[Any]]:
    """Consecutive items of one op."""
    out: list[Sequence[Any]] = []
    i = 0
    while i < len(items):
        j = i
        while j < len(items) and items[j].op is items[i].op:
            j += 1
        out.append(items[i:j])
        i = j
    return out

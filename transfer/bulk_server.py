"""The holder's end of the bulk path: a listening socket and one thread per
peer connection, serving READ/WRITE ranges straight into and out of segments.

Every range of a request is checked by the segment server's one validator
(:meth:`~kvpool.transfer.segment_server.SegmentServer.check`: ownership, op,
bounds, size limit, capability) before any byte moves; the reply carries one
code per range. A refused range of a WRITE has its payload read and dropped
so the stream stays in step; a header that does not decode closes the
connection. Each request is recorded once, when served (its accepted
ranges and their bytes, and the seconds from its header to its reply:
:class:`~kvpool.transfer.counters.OpCounter`). Stream mechanics:
:mod:`kvpool.transfer.bulk`.
"""

from __future__ import annotations

import logging
import operator
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.core import spin as _spin
from kvpool.core.errors import KVPoolError
from kvpool.transfer import wire
from kvpool.transfer.bulk import BulkStream, bulk_frame, set_congestion
from kvpool.transfer.counters import OpCells, OpCounter
from kvpool.transfer.types import TransferOp

__all__ = ["BulkServer", "RangeValidator"]

log = logging.getLogger(__name__)

_MAX_CONNS = 64
_IDLE_S = 300.0  # a silent connection is closed after this long
_DISCARD = 1 << 20  # scratch for the payloads of refused WRITE ranges
_UNSET: Any = object()
_LEN = operator.attrgetter("len")

#: (op, items, capability table) -> (codes, segments, first refusal): checks
#: every range of one request; a segment (anything with ``view()``,
#: ``write_from()``, ``read_payload()``) where the code is 0, None where refused;
#: the first refusal's error (None when every range is accepted).
RangeValidator = Callable[[int, list[wire.BulkItem], list[bytes]],
                          tuple[list[int], list[Any], KVPoolError | None]]


class BulkServer:
    """Listening socket + one thread per peer connection (at most 64).

    ``validate`` checks the ranges of one request (:data:`RangeValidator`);
    ``count(served, refused)`` records how many of them it accepted and
    refused. ``congestion``: the
    ``tcp_congestion`` policy of accepted connections (:func:`set_congestion`).
    ``cells``: where served requests are recorded, by op (own ones if None).
    ``spin_us``: how long a connection's thread polls for the next request
    after a reply, while the peer's requests have of late come that soon
    (0: never; :mod:`kvpool.core.spin`). ``close()`` stops it.
    """

    def __init__(self, bind_host: str, validate: RangeValidator,
                 count: Callable[[int, int], None], max_header_bytes: int,
                 max_request_bytes: int, congestion: str = "auto",
                 cells: OpCells | None = None, spin_us: float = 0.0) -> None:
        self._validate = validate
        self.spin_s = spin_us / 1e6
        self._congestion = congestion
        self._count = count
        self.cells: OpCells = cells or (OpCounter(), OpCounter(), OpCounter())
        self.max_header_bytes = max_header_bytes
        self._max_req = max_request_bytes
        self._lst = socket.create_server((bind_host, 0))
        self._lst.settimeout(0.2)
        self.port: int = self._lst.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvpool-bulk:{self.port}")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._lst.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            set_congestion(conn, self._congestion)  # before its first reply is sent
            with self._lock:
                if self._stop.is_set() or len(self._conns) >= _MAX_CONNS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                             name=f"kvpool-bulk-conn:{self.port}").start()

    def _serve_conn(self, conn: socket.socket) -> None:
        stream = BulkStream(conn, self.max_header_bytes)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._serve_loop(stream, memoryview(bytearray(_DISCARD)))
        except (OSError, KVPoolError) as exc:
            log.debug("bulk connection closed: %s", exc)
        except Exception:  # never let one peer take the process down
            log.exception("bulk server: unexpected error")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_loop(self, stream: BulkStream, scratch: memoryview) -> None:
        """Serve one connection's requests until it ends. With ``spin_s``, a
        poll for the next request after each reply, while of late the next
        request came within it (a moving average of the gaps, each capped at
        twice the window; a gap slept through counts as the window, and a
        shut gate still polls now and then: :mod:`kvpool.core.spin`)."""
        spin = self.spin_s
        gap = end = 0.0
        polled = False
        skipped = [0]
        while not self._stop.is_set():
            if spin:
                end = time.perf_counter()
                polled = _spin.polling() and (gap < spin or _spin.probe(skipped, 0))
                if polled:
                    stream.spin_until = end + spin
            if not self._serve_one(stream, scratch):
                return
            if spin:  # (every served request read a header: its arrival is fresh)
                gap += (_spin.wait_sample(stream.arrived - end, polled, spin) - gap) * 0.125

    def _check(self, req: wire.BulkRequest) -> tuple[list[int], list[Any], str]:
        """Validate and count every range: (codes, segments (None where
        refused), the first refusal's text)."""
        codes, segs, refusal = self._validate(req.op, req.items, req.caps)
        n = len(codes)
        if refusal is None:
            self._count(n, 0)
            return codes, segs, ""
        ok = codes.count(0)
        self._count(ok, n - ok)
        return codes, segs, str(refusal)

    def _serve_one(self, stream: BulkStream, scratch: memoryview) -> bool:
        """One request; False when the connection is done (EOF, or out of step)."""
        raw = stream.read_frame(self.max_header_bytes, time.monotonic() + _IDLE_S)
        if raw is None:
            return False
        t0 = time.monotonic()
        deadline = t0 + _IDLE_S
        req = wire.decode_bulk_request(raw)  # undecodable: the stream is lost, close
        codes, segs, err = self._check(req)
        if len(codes) == 1 and not codes[0]:  # one accepted range: a lone put or get
            view = segs[0].view()
            if view is not None:
                if not self._serve_single(stream, req, view, deadline):
                    return False
                self.cells[req.op].record(1, req.items[0].len, time.monotonic() - t0)
                return True
        reply = bulk_frame(wire.BulkReply(req.id, codes, err))
        if req.op == TransferOp.WRITE:
            if None in segs and any(s is None and not 0 <= it.len <= self._max_req
                                    for it, s in zip(req.items, segs, strict=True)):
                # a refused range whose payload length cannot be trusted: the
                # stream cannot be kept in step; answer, then close
                stream.write([reply], deadline)
                return False
            if not self._receive(stream, req.items, segs, scratch, deadline):
                return False
            stream.write([reply], deadline)
        elif req.op == TransferOp.READ:
            stream.write([reply, *self._payloads(req.items, segs)], deadline)
        else:
            stream.write([reply], deadline)
            return True  # an unknown op: every range refused, nothing served
        if err:
            accepted = [it for it, s in zip(req.items, segs, strict=True) if s is not None]
        else:
            accepted = req.items
        if accepted:
            self.cells[req.op].record(len(accepted), sum(map(_LEN, accepted)),
                                      time.monotonic() - t0)
        return True

    @staticmethod
    def _serve_single(stream: BulkStream, req: wire.BulkRequest, view: memoryview,
                      deadline: float) -> bool:
        """:meth:`_serve_one` of a request of one accepted range on a mapped
        segment (``view``): payload straight into / out of the mapping; False
        on EOF."""
        it = req.items[0]
        n = it.len
        reply = bulk_frame(wire.BulkReply(req.id, [0]))
        if not n:
            stream.write_views([reply], deadline)
        elif req.op == TransferOp.WRITE:
            if not stream.read_into([view[it.off:it.off + n]], deadline):
                return False
            stream.write_views([reply], deadline)
        else:
            stream.write_views([reply, view[it.off:it.off + n]], deadline)
        return True

    @staticmethod
    def _payloads(items: list[wire.BulkItem], segs: list[Any]) -> list[Any]:
        """A READ's payloads, accepted ranges only: slices of each segment's
        mapping (taken once per segment), or ``read_payload`` copies."""
        out: list[Any] = []
        mapped: dict[int, Any] = {}
        for it, seg in zip(items, segs, strict=True):
            if seg is None:
                continue
            view = mapped.get(id(seg), _UNSET)
            if view is _UNSET:
                view = mapped[id(seg)] = seg.view()
            out.append(view[it.off:it.off + it.len] if view is not None
                       else seg.read_payload(it.off, it.len))
        return out

    def _receive(self, stream: BulkStream, items: list[wire.BulkItem], segs: list[Any],
                 scratch: memoryview, deadline: float) -> bool:
        """Receive a WRITE's payloads: accepted ranges straight into their
        segments, refused ones into scratch (dropped). False on EOF."""
        seg0 = segs[0] if segs else None
        if seg0 is not None and segs.count(seg0) == len(segs):  # one segment, all accepted
            view = seg0.view()
            if view is not None:
                return stream.read_into([view[it.off:it.off + it.len] for it in items], deadline)
        views: list[memoryview] = []
        staged: list[tuple[Any, int, np.ndarray]] = []  # segments without a mapping
        mapped: dict[int, Any] = {}  # id(segment) -> its view (one per segment, not per range)
        for it, seg in zip(items, segs, strict=True):
            if seg is None:
                left = it.len
                while left:
                    k = min(left, len(scratch))
                    views.append(scratch[:k])
                    left -= k
                continue
            view = mapped.get(id(seg), _UNSET)
            if view is _UNSET:
                view = mapped[id(seg)] = seg.view()
            if view is not None:
                views.append(view[it.off:it.off + it.len])
            else:
                tmp = np.empty(it.len, dtype=np.uint8)
                staged.append((seg, it.off, tmp))
                views.append(tmp.data)
        if not stream.read_into(views, deadline):
            return False
        for seg, off, tmp in staged:
            seg.write_from(off, tmp)
        return True

    def close(self) -> None:
        """Stop accepting, cut every connection, join the accept thread."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._lst.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)

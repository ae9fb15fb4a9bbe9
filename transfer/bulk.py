"""Plain-TCP bulk path of the ``tcp`` transport: payloads land in place.

Over ZeroMQ every payload is copied once more than over a raw socket: the
receiving I/O thread reads it into a ZeroMQ message and the application then
copies that into the segment (WRITE) or the caller's buffer (READ). At 16 MiB
that extra memcpy is ~25% of the time on loopback. This path reads straight
into the destination (``recv_into`` of the segment / buffer slice) and sends
straight from the source.

It sits beside the :class:`~kvpool.transfer.server.TransferServer` (same
validation: ``TransferServer._validate`` — ownership, op, bounds, size limit,
capability — before any byte moves) and is only offered when the transfer
server runs without CURVE; a client with CURVE active for the peer never uses
it. Peers find its port with the transfer server's ``OP_BULK`` request.

Stream format, both directions: ``[u32 LE header length][msgpack header]``
then the payload when there is one. Request header as the ZeroMQ protocol's
(``op`` READ|WRITE, ``id``, ``seg``, ``off``, ``len``, ``cap``); WRITE is
followed by exactly ``len`` bytes. Reply ``{id, code, err}``, then ``len``
bytes for a successful READ. A refused WRITE's payload is read and dropped so
the stream stays in step; anything unparseable closes the connection.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import decode_frame, encode_frame
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["BulkClient", "BulkServer"]

log = logging.getLogger(__name__)

_HDR = 4
_MAX_CONNS = 64
_IDLE_S = 300.0  # a silent connection is closed after this long
_DISCARD = 1 << 20


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on EOF."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return False
        got += k
    return True


def _send_msg(sock: socket.socket, hdr: dict[str, Any], payload: Any = None) -> None:
    raw = encode_frame(hdr)
    sock.sendall(len(raw).to_bytes(_HDR, "little") + raw)
    if payload is not None:
        sock.sendall(payload)


def _recv_hdr(sock: socket.socket, max_bytes: int) -> Any:
    """One header; None on a clean EOF; KVPoolError(MALFORMED_FRAME) if bad."""
    lb = bytearray(_HDR)
    if not _recv_exact(sock, memoryview(lb)):
        return None
    n = int.from_bytes(lb, "little")
    if n > max_bytes:
        raise KVPoolError(f"header of {n} bytes", ErrorCode.FRAME_TOO_LARGE)
    raw = bytearray(n)
    if not _recv_exact(sock, memoryview(raw)):
        raise KVPoolError("connection closed inside a header", ErrorCode.MALFORMED_FRAME)
    return decode_frame(bytes(raw))


class BulkServer:
    """Listening socket + one thread per peer connection (at most 64).

    ``validate(hdr) -> (segment, op, off, n)`` raises KVPoolError to refuse;
    ``count(ok)`` records a served / refused request. ``close()`` stops it.
    """

    def __init__(self, bind_host: str,
                 validate: Callable[[dict[str, Any]], tuple[Any, int, int, int]],
                 count: Callable[[bool], None], max_header_bytes: int,
                 max_request_bytes: int) -> None:
        self._validate = validate
        self._count = count
        self._max_hdr = max_header_bytes
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
            with self._lock:
                if self._stop.is_set() or len(self._conns) >= _MAX_CONNS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                             name=f"kvpool-bulk-conn:{self.port}").start()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_IDLE_S)
            while not self._stop.is_set() and self._serve_one(conn):
                pass
        except (OSError, KVPoolError) as exc:
            log.debug("bulk connection closed: %s", exc)
        except Exception:  # never let one peer take the process down
            log.exception("bulk server: unexpected error")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        hdr = _recv_hdr(conn, self._max_hdr)
        if hdr is None:
            return False
        if not isinstance(hdr, dict):
            raise KVPoolError("header is not a map", ErrorCode.MALFORMED_FRAME)
        rid = hdr.get("id")
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        op_raw, n_raw = hdr.get("op"), hdr.get("len")
        try:
            if op_raw not in (TransferOp.READ, TransferOp.WRITE) or isinstance(op_raw, bool):
                raise KVPoolError(f"unknown op {op_raw!r} on the bulk path", ErrorCode.UNKNOWN_OP)
            seg, op, off, n = self._validate(hdr)
        except KVPoolError as exc:
            self._count(False)
            if op_raw == TransferOp.WRITE:
                # keep the stream in step: drop the payload the peer already sent
                if not (isinstance(n_raw, int) and 0 <= n_raw <= self._max_req):
                    _send_msg(conn, {"id": rid, "code": int(exc.code), "err": str(exc)})
                    return False
                scratch = memoryview(bytearray(min(_DISCARD, max(1, n_raw))))
                left = n_raw
                while left:
                    k = min(left, len(scratch))
                    if not _recv_exact(conn, scratch[:k]):
                        return False
                    left -= k
            _send_msg(conn, {"id": rid, "code": int(exc.code), "err": str(exc)})
            return True
        if op == TransferOp.WRITE:
            view = seg.view()
            if view is not None:
                ok = _recv_exact(conn, view[off:off + n])
            else:
                tmp = np.empty(n, dtype=np.uint8)
                ok = _recv_exact(conn, tmp.data)
                if ok:
                    seg.write_from(off, tmp)
            if not ok:
                return False
            self._count(True)
            _send_msg(conn, {"id": rid, "code": 0, "err": ""})
        else:
            payload = seg.read_payload(off, n)
            self._count(True)
            _send_msg(conn, {"id": rid, "code": 0, "err": ""}, payload)
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


class BulkClient:
    """One blocking connection to a peer's bulk port (used by one thread)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=max(0.01, timeout))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.broken = False
        self._ids = 0

    def run(self, items: Sequence[Any], deadline: float, report: Callable[..., None],
            final_codes: set[ErrorCode], now: Callable[[], float]) -> None:
        """Execute host-buffer READ/WRITE work items in order, pipelined per run of
        one op (a mixed run could fill both directions' socket buffers at once).
        Reports each item. Marks the client broken on a stream error or timeout,
        failing what is left (retryable)."""
        i = 0
        while i < len(items):
            j = i
            while j < len(items) and items[j].op is items[i].op:
                j += 1
            self._run_group(items[i:j], deadline, report, final_codes, now)
            if self.broken:
                for it in items[j:]:
                    report(it, TransferError("bulk connection lost", ErrorCode.TRANSFER_FAIL))
                return
            i = j

    def _run_group(self, items: Sequence[Any], deadline: float, report: Callable[..., None],
                   final_codes: set[ErrorCode], now: Callable[[], float]) -> None:
        sock = self.sock
        done = 0
        try:
            ids = []
            for it in items:
                left = deadline - now()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                self._ids += 1
                ids.append(self._ids)
                hdr = {"op": int(it.op), "id": self._ids, "seg": it.segment.segment_id,
                       "off": it.offset, "len": it.length, "cap": it.capability}
                payload = it.buffer.host_view(it.buffer_offset, it.length) \
                    if it.op is TransferOp.WRITE else None
                _send_msg(sock, hdr, payload)
            for it, rid in zip(items, ids, strict=True):
                left = deadline - now()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                rep = _recv_hdr(sock, 1 << 16)
                if not isinstance(rep, dict) or rep.get("id") != rid:
                    raise ConnectionError("bulk reply out of step")
                code = ErrorCode(int(rep.get("code", ErrorCode.INTERNAL_ERROR)))
                if code != ErrorCode.OK:
                    done += 1
                    report(it, TransferError(f"peer: {rep.get('err', '')}", code,
                                             retryable=code not in final_codes))
                    continue
                if it.op is TransferOp.READ:
                    dst = it.buffer.host_view(it.buffer_offset, it.length)
                    if not _recv_exact(sock, memoryview(dst).cast("B")):
                        raise ConnectionError("peer closed the bulk connection")
                done += 1
                report(it, None)
        except TimeoutError:
            self._fail(items[done:], report, "no reply before the deadline", ErrorCode.TIMEOUT)
        except (OSError, ConnectionError, KVPoolError, ValueError) as exc:
            self._fail(items[done:], report, f"bulk connection: {exc}", ErrorCode.TRANSFER_FAIL)

    def _fail(self, items: Sequence[Any], report: Callable[..., None], why: str,
              code: ErrorCode) -> None:
        self.broken = True
        for it in items:
            report(it, TransferError(why, code))

    def close(self) -> None:
        self.sock.close()

"""The bulk sockets of the ``tcp`` transport, requester side: what is known of
each peer's bulk port, the idle connections to it, and the helper threads
that run the extra connections of a sub-batch.

A peer first met is taken at the word of its segment descriptor
(``extra["bulk"]``, published by its owner); one that publishes nothing is
asked with the transfer server's ``ServerOp.BULK`` request in the background
and served over ZeroMQ meanwhile; a peer whose port refused a connection is
asked, not taken at its word, and believed to have none for
``_BULK_RETRY_S``. With CURVE active towards a peer its bulk socket is never
used (the bulk path is plain TCP). Connections are checked out by one thread
at a time and kept idle between sub-batches.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor
from kvpool.transfer import wire
from kvpool.transfer.bulk_client import DEFAULT_SPIN_US, BulkClient

if TYPE_CHECKING:
    from kvpool.transfer.transports.tcp import TcpTransport

__all__ = ["BulkHelpers", "BulkPeer", "BulkPeers"]

log = logging.getLogger(__name__)

_BULK_RETRY_S = 10.0  # how long "this peer has no bulk socket" is believed
_HELPER_IDLE_S = 30.0  # a bulk helper thread idle this long exits
_HELPERS_KEPT = 8  # idle bulk helper threads kept at most


@dataclass(frozen=True)
class BulkPeer:
    """What a peer's ``ServerOp.BULK`` answer said (port 0: none, or not yet known)."""

    port: int = 0
    retry_at: float = 0.0  # monotonic time to ask again (port 0 only)
    max_bytes: int = 0  # largest single range
    max_header: int = 4096  # largest request header
    caps_table: bool = False  # takes a request's capability table
    published: bool = False  # taken from a segment descriptor, not asked


class BulkPeers:
    """The bulk ports of ``tcp``'s peers and the idle connections to them.
    ``known`` maps an endpoint to what is known of it (read without the lock
    on the hot path)."""

    def __init__(self, tcp: TcpTransport) -> None:
        self._tcp = tcp
        # transports.tcp.options.reply_spin_us: how long a connection polls for the
        # reply to a small request before sleeping
        self.spin_us = float(tcp.settings.options.get("reply_spin_us", DEFAULT_SPIN_US))
        self._lock = threading.Lock()
        self.known: dict[str, BulkPeer] = {}
        self.clients: set[BulkClient] = set()  # every open connection
        self.idle: dict[str, list[BulkClient]] = {}
        self.closed = False

    def peer(self, endpoint: str, seg: SegmentDescriptor | None = None) -> BulkPeer:
        """What is known of the peer's bulk socket (port 0: none, not known yet, or
        CURVE active towards it). Never blocks: see the module doc."""
        now = time.monotonic()
        with self._lock:
            peer = self.known.get(endpoint)
            if peer is not None and (peer.port > 0 or now < peer.retry_at):
                return peer
            # (the CURVE check only here: a known peer, the common case, skips it)
            curve = self._tcp.curve()
            plain = curve is None or not curve.active(endpoint)
            hint = wire.bulk_hint(seg.extra) if peer is None and seg is not None and plain \
                else None
            if hint is not None:
                peer = self.known[endpoint] = BulkPeer(
                    hint.bulk, 0.0, hint.max, hint.hdr or 4096, hint.caps, published=True)
                return peer
            # negative until the answer arrives (or for _BULK_RETRY_S on failure)
            peer = self.known[endpoint] = BulkPeer(retry_at=now + _BULK_RETRY_S)
        if plain:
            self.ask(endpoint)
        return peer

    def ask(self, endpoint: str) -> None:
        """Ask the peer for its bulk port in the background."""
        threading.Thread(target=self.query, args=(endpoint, 1.0), daemon=True,
                         name="kvpool-tcp-bulk-query").start()

    def query(self, endpoint: str, timeout: float) -> None:
        """Send ``ServerOp.BULK`` to the peer's transfer server; learn the answer."""
        try:
            s = self._tcp.zmq.socket()
        except Exception:  # closing
            return
        try:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send(wire.encode(wire.ServerRequest(op=wire.ServerOp.BULK, id=0)))
            if not s.poll(int(timeout * 1000) + 1, zmq.POLLIN):
                return
            rep = wire.decode_reply(s.recv_multipart()[-1], offer=True)
            if isinstance(rep, wire.BulkOffer) and rep.code == ErrorCode.OK \
                    and 0 < rep.bulk < 65536:
                with self._lock:
                    self.known[endpoint] = BulkPeer(rep.bulk, 0.0, rep.max, rep.hdr or 4096,
                                                    rep.caps)
        except Exception as exc:  # an old or odd peer, or closing: no bulk path
            log.debug("tcp: bulk port of %s: %s", endpoint, exc)
        finally:
            self._tcp.zmq.release(s)

    def checkout(self, endpoint: str, deadline: float) -> BulkClient | None:
        """An idle connection to the peer's bulk port, or a new one (None: cannot connect)."""
        with self._lock:
            idle = self.idle.get(endpoint)
            if idle:
                return idle.pop()
            peer = self.known[endpoint]
        host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        try:
            ctx = self._tcp.ctx
            bc = BulkClient(host, peer.port, min(2.0, deadline - time.monotonic()),
                            peer.max_header, peer.caps_table,
                            ctx.tcp_congestion if ctx is not None else "auto",
                            self.spin_us)
        except OSError as exc:
            log.debug("tcp: bulk connect %s:%d: %s", host, peer.port, exc)
            with self._lock:
                self.known[endpoint] = BulkPeer(retry_at=time.monotonic() + _BULK_RETRY_S)
            if peer.published:  # a stale descriptor (the owner restarted?): ask the peer
                self.ask(endpoint)
            return None
        with self._lock:
            if self.closed:
                bc.close()
                return None
            self.clients.add(bc)
        return bc

    def checkin(self, endpoint: str, bc: BulkClient) -> None:
        """Give a connection back: kept idle unless it broke (or we closed)."""
        with self._lock:
            if not bc.broken and not self.closed:
                self.idle.setdefault(endpoint, []).append(bc)
                return
            self.clients.discard(bc)
        bc.close()

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            self.closed = True
            clients, self.clients = list(self.clients), set()
            self.idle.clear()
        for bc in clients:
            bc.close()


class BulkHelpers:
    """Threads kept for the extra connections of a sub-batch (the stripes of a
    large item, the other peers of a sub-batch): a thread started per job cost
    each striped request a start-up hand-off, which on a busy host came late.
    A job never waits for a busy helper (a new thread is started then), so a
    silent peer still cannot hold up a live one; a helper idle for
    ``_HELPER_IDLE_S`` exits, and at most ``_HELPERS_KEPT`` wait at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Any]] = []
        self._closed = False

    def submit(self, fn: Any, args: tuple[Any, ...]) -> threading.Event:
        """Run ``fn(*args)`` on an idle helper or a new thread; the event is set
        when it returns (or raises)."""
        done = threading.Event()
        with self._lock:
            q = self._idle.pop() if self._idle else None
        if q is not None:
            q.put((fn, args, done))
            return done
        q = queue.SimpleQueue()
        q.put((fn, args, done))
        threading.Thread(target=self._loop, args=(q,), daemon=True,
                         name="kvpool-tcp-bulk").start()
        return done

    def _loop(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            try:
                job = q.get(timeout=_HELPER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if q in self._idle:  # else a job was just handed to it: take it
                        self._idle.remove(q)
                        return
                job = q.get()
            if job is None:
                return
            fn, args, done = job
            try:
                fn(*args)
            except Exception:  # the job reports its own items; never lose the helper silently
                log.exception("tcp: bulk helper job failed")
            finally:
                done.set()
            del fn, args, done, job  # no references kept while idle
            with self._lock:
                if self._closed or len(self._idle) >= _HELPERS_KEPT:
                    return
                self._idle.append(q)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for q in idle:
            q.put(None)

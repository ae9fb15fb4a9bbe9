"""The segment server: what a holder runs so that peers may READ/WRITE its
segments, and the one place that decides whether they may.

It owns the capability verifier (the keys the master handed over per segment,
the epoch high-water, refusals by reason: docs/security.md), the one
validator every serving path calls (:meth:`SegmentServer.check`: a batch of
ranges; a lone request is a batch of one), the request counters (ranges
served and refused; per loop and op, bytes and latency in
:class:`~kvpool.transfer.counters.TransferCounters` as ``served`` by
``tcp_zmq`` and ``tcp_bulk``), and the two
serving loops: the ZeroMQ :class:`~kvpool.transfer.server.TransferServer`
and, without CURVE, the plain-TCP
:class:`~kvpool.transfer.bulk_server.BulkServer`. The transfer engine holds
one and delegates its capability calls to it.

The validator's checks, in order, per range: op READ or WRITE
(UNKNOWN_OP), a capability named by index lies inside the request's table
(MALFORMED_FRAME), segment owned here (SEGMENT_NOT_FOUND), op allowed on it
(PERMISSION_DENIED), length below ``max_request_bytes`` (FRAME_TOO_LARGE),
range inside the segment (OUT_OF_BOUNDS), then the capability hook
(:attr:`SegmentServer.verify_capability`: PERMISSION_DENIED or STALE_EPOCH
with the reason). The common request (every range on one segment under one
token, all allowed) is proved in one pass: the segment looked up once, one
capability check for all ranges; anything else is checked range by range.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from kvpool.core.auth import CurveConfig
from kvpool.core.capability import CapabilityVerifier as CapVerifier
from kvpool.core.capability import CapOp
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer import wire
from kvpool.transfer.bulk_server import BulkServer
from kvpool.transfer.config import ServerConfig
from kvpool.transfer.counters import Direction, TransferCounters
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.server import TransferServer
from kvpool.transfer.types import TransferOp

__all__ = ["CapabilityVerifier", "SegmentServer"]

log = logging.getLogger(__name__)

#: (segment, op, offset, length, capability) -> None to allow, or an ErrorCode
#: to refuse (it may also raise a KVPoolError with the reason).
CapabilityVerifier = Callable[[LocalSegment, TransferOp, int, int, bytes], ErrorCode | None]

_OPS = {int(TransferOp.READ): TransferOp.READ, int(TransferOp.WRITE): TransferOp.WRITE}
_CAP_OPS = {TransferOp.READ: CapOp.READ, TransferOp.WRITE: CapOp.WRITE}

#: the validator's answer: a code and a segment (None where refused) per range,
#: and the first refusal (None when every range is accepted)
Checked = tuple[list[int], list[LocalSegment | None], KVPoolError | None]


class SegmentServer:
    """Serves the segments ``lookup(segment_id)`` returns (None: not owned here).

    With ``config.enabled`` the ZeroMQ server listens on ``bind_host:port``
    (port 0 = ephemeral; ``endpoint`` is what peers connect to) and, unless
    CURVE is on or ``config.bulk`` is off, the bulk socket beside it
    (``bulk``); otherwise nothing listens (``serving`` False, ``endpoint``
    "") and the capability calls still keep their state.
    ``tcp_congestion``: the policy of the bulk socket's connections.
    ``counters``: where the loops record what they serve (own ones if None).
    ``close()`` stops the loops.
    """

    def __init__(self, lookup: Callable[[str], LocalSegment | None],
                 config: ServerConfig | None = None, bind_host: str = "127.0.0.1",
                 port: int = 0, curve: CurveConfig | None = None,
                 tcp_congestion: str = "auto", counters: TransferCounters | None = None) -> None:
        self.config = config or ServerConfig()
        self.counters = counters or TransferCounters()
        self._lookup = lookup
        self._max_request = int(self.config.max_request_bytes)
        #: the capability keys of the local segments, refusals counted by reason
        self.capabilities = CapVerifier(required=self.config.capabilities == "on",
                                        leeway_ms=self.config.capability_leeway_ms)
        self._own_hook: CapabilityVerifier = self._verify_range
        #: the per-range capability check (None: every range allowed). The
        #: server's own is installed while capabilities apply (``on``, or a key
        #: was set); while it is, a request under one token is checked once for
        #: all its ranges. Another hook put here is asked range by range.
        self.verify_capability: CapabilityVerifier | None = \
            self._own_hook if self.config.capabilities == "on" else None
        self.requests_served = 0
        self.requests_refused = 0
        self.zmq: TransferServer | None = None
        self.bulk: BulkServer | None = None
        if not self.config.enabled:
            return
        self.zmq = TransferServer(self, bind_host, port, self.config, curve,
                                  self.counters.cells(Direction.SERVED, "tcp_zmq"))
        if self.config.bulk and not self.zmq.curve:  # payloads in place over plain TCP
            try:
                self.bulk = BulkServer(bind_host, self.check, self.count,
                                       int(self.config.max_header_bytes),
                                       self._max_request, tcp_congestion,
                                       self.counters.cells(Direction.SERVED, "tcp_bulk"),
                                       spin_us=self.config.bulk_spin_us)
            except BaseException:
                self.zmq.close()
                raise

    # -- where peers reach it -----------------------------------------------------
    @property
    def serving(self) -> bool:
        """Whether the loops were started (``config.enabled``)."""
        return self.zmq is not None

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` of the ZeroMQ server ("" when not serving)."""
        return self.zmq.endpoint if self.zmq is not None else ""

    @property
    def host(self) -> str:
        """The address the server is bound to ("" when not serving)."""
        return self.zmq.host if self.zmq is not None else ""

    @property
    def curve(self) -> bool:
        """Whether the ZeroMQ socket requires CURVE."""
        return self.zmq is not None and self.zmq.curve

    def bulk_offer(self, rid: int | None = 0) -> wire.BulkOffer:
        """What ``ServerOp.BULK`` answers: the bulk port (0: none) and its limits.
        Also published ahead in the ``extra["bulk"]`` of this server's memory
        segments' descriptors, so a peer's first request need not ask."""
        return wire.BulkOffer(rid, 0, bulk=self.bulk.port if self.bulk is not None else 0,
                              max=self._max_request,
                              hdr=int(self.config.max_header_bytes), caps=True)

    def bulk_extra(self) -> dict[str, Any]:
        """The ``extra`` entry of this server's memory segments' descriptors:
        ``{"bulk": {...}}`` (see :func:`wire.bulk_hint`), {} without a bulk socket."""
        if self.bulk is None:
            return {}
        o = self.bulk_offer()
        return {"bulk": {"bulk": o.bulk, "max": o.max, "hdr": o.hdr, "caps": o.caps}}

    # -- capabilities (docs/security.md) ------------------------------------------------
    def set_capability_key(self, segment_id: str, key: bytes) -> None:
        """Install the key the master handed over at (re-)mount for a local
        segment. From then on (unless ``capabilities: off``) every READ/WRITE
        of it needs a capability signed with this key (PERMISSION_DENIED)."""
        if self.config.capabilities == "off":
            return
        self.capabilities.set_key(segment_id, key)
        self.verify_capability = self._own_hook

    def remove_capability_key(self, segment_id: str) -> None:
        """Forget the key of a segment (it is no longer served)."""
        self.capabilities.remove_key(segment_id)

    def observe_master_epoch(self, epoch: int) -> None:
        """The master's leader epoch (from its PING reply): capabilities signed
        in an older term are refused from now on (STALE_EPOCH, docs/ha.md)."""
        if self.capabilities.observe_epoch(epoch):
            log.info("capability epoch raised to %d by the master", epoch)

    def capability_stats(self) -> dict[str, Any]:
        """``capability_refusals`` by reason, ``capability_accepted`` and the epoch."""
        v = self.capabilities
        return {"capability_refusals": {r.value: n for r, n in v.refusals.items()},
                "capability_accepted": v.accepted, "capability_epoch": v.epoch}

    def _verify_range(self, seg: LocalSegment, op: TransferOp, off: int, n: int,
                      cap: bytes) -> ErrorCode | None:
        """The server's own per-range hook: raises CapabilityError (with the
        reason) to refuse. A segment without a key passes in ``auto`` mode."""
        v = self.capabilities
        if not v.required and not v.has_key(seg.segment_id):
            return None
        # a CapOp spares the verifier's by-name coercion of each range's op
        v.check(cap, seg.segment_id, off, n, _CAP_OPS.get(op, op), required=True)
        return None

    # -- the validator ------------------------------------------------------------------
    def check(self, op: int, items: list[wire.BulkItem], table: list[bytes]) -> Checked:
        """Check every range of one request (``op`` on each of ``items``;
        ``item.cap`` a token or an index into ``table``) before any byte moves:
        a code per range (0: accepted), its segment (None where refused), and
        the first refusal. Counts nothing (the serving loop does)."""
        top = _OPS.get(op)
        if top is not None and items:
            seg = self._all_allowed(top, items, table)
            if seg is not None:
                n = len(items)
                return [0] * n, [seg] * n, None
        return self._check_each(op, top, items, table)

    def _all_allowed(self, top: TransferOp, items: list[wire.BulkItem], table: list[bytes]
                     ) -> LocalSegment | None:
        """The segment of the common request, proved in one pass: every range
        on one segment under one token, inside it and below the size limit,
        and the capability allowing them all (one check). None where any of
        that does not hold (nothing refused here: the caller checks each range)."""
        first = items[0]
        sid, ref = first.seg, first.cap
        if type(ref) is int:
            if not 0 <= ref < len(table):
                return None
            cap = table[ref]
        else:
            cap = cast(bytes, ref)
        seg = self._lookup(sid)
        if seg is None or top not in seg.allowed_ops:
            return None
        size, max_n = seg.size, self._max_request
        offs: list[int] = []
        lens: list[int] = []
        for it in items:
            off, n = it.off, it.len
            if it.seg != sid or it.cap != ref or off < 0 or n < 0 or n > max_n \
                    or off + n > size:
                return None
            offs.append(off)
            lens.append(n)
        hook = self.verify_capability
        if hook is not None:
            if hook is not self._own_hook:  # a hook of its own: asked range by range
                return None
            v = self.capabilities
            if (v.required or v.has_key(sid)) \
                    and not v.check_many(cap, sid, offs, lens, _CAP_OPS[top]):
                return None
        return seg

    def _check_each(self, op: int, top: TransferOp | None, items: list[wire.BulkItem],
                    table: list[bytes]) -> Checked:
        """:meth:`check` range by range, with a code for each. What depends only
        on the segment (owned here, op allowed) is looked up once per segment."""
        codes: list[int] = []
        segs: list[LocalSegment | None] = []
        first: KVPoolError | None = None
        known: dict[str, LocalSegment | tuple[ErrorCode, str]] = {}
        max_n = self._max_request
        hook = self.verify_capability
        ntable = len(table)
        for it in items:
            sid, off, n, ref = it.seg, it.off, it.len, it.cap
            try:
                if top is None:
                    raise KVPoolError(f"unknown op {op!r}", ErrorCode.UNKNOWN_OP)
                if type(ref) is int:  # an index into the request's table
                    if not 0 <= ref < ntable:
                        raise KVPoolError(f"capability index {ref} outside the request's "
                                          f"{ntable}", ErrorCode.MALFORMED_FRAME)
                    cap = table[ref]
                else:
                    cap = cast(bytes, ref)
                seg = known.get(sid)
                if seg is None:
                    seg = known[sid] = self._segment_for(top, sid)
                if type(seg) is tuple:
                    raise KVPoolError(seg[1], seg[0])
                seg = cast(LocalSegment, seg)
                if n > max_n:
                    raise KVPoolError(f"request of {n} bytes exceeds {max_n}",
                                      ErrorCode.FRAME_TOO_LARGE)
                if off < 0 or n < 0 or off + n > seg.size:
                    raise KVPoolError(f"range [{off}, {off + n}) outside segment {sid!r} of "
                                      f"{seg.size} bytes", ErrorCode.OUT_OF_BOUNDS)
                if hook is not None:
                    code = hook(seg, top, off, n, cap)
                    if code is not None and code != ErrorCode.OK:
                        raise KVPoolError(f"capability refused for {sid!r}", code)
                segs.append(seg)
                codes.append(0)
            except KVPoolError as exc:
                segs.append(None)
                codes.append(int(exc.code))
                if first is None:  # kept without its traceback: no reference cycle
                    first = exc.with_traceback(None)
        return codes, segs, first

    def _segment_for(self, top: TransferOp, sid: str) -> LocalSegment | tuple[ErrorCode, str]:
        """The segment ``sid`` if it is owned here and allows ``top``, else why
        not as (code, text)."""
        seg = self._lookup(sid)
        if seg is None:
            return ErrorCode.SEGMENT_NOT_FOUND, f"segment {sid!r} is not owned here"
        if top not in seg.allowed_ops:
            return ErrorCode.PERMISSION_DENIED, f"{top.name} not allowed on segment {sid!r}"
        return seg

    # -- counters and lifecycle ---------------------------------------------------------
    def count(self, served: int, refused: int) -> None:
        """Record requests (ranges) served and refused by either loop."""
        self.requests_served += served
        self.requests_refused += refused

    def stats(self) -> dict[str, Any]:
        """Counters: requests served / refused, CURVE, and the capability stats."""
        out: dict[str, Any] = {"served": self.requests_served, "refused": self.requests_refused,
                               "curve": self.curve,
                               "curve_denied": self.zmq.curve_denied if self.zmq else 0}
        out.update(self.capability_stats())
        return out

    def close(self) -> None:
        """Stop both loops. Idempotent; the capability state stays."""
        if self.bulk is not None:
            self.bulk.close()
        if self.zmq is not None:
            self.zmq.close()

"""``rdma``: remote memory segments over RC queue pairs (RDMA READ/WRITE).

Not yet run on RDMA hardware: the data path is exercised against a loopback
test double of the verbs layer (tests/support/verbs_double.py); see
docs/rdma.md.

How it works:

- **Availability.** ``pyverbs`` is imported lazily; :meth:`RdmaTransport.available`
  is (False, reason) when it is missing or no device exists (pyverbs raises
  from ``get_device_list()`` then), and the engine skips the transport with one
  log line, so the selector's ``[rdma, tcp]`` rule falls through to tcp.
- **Connections** (:mod:`~kvpool.transfer.transports.rdma_connect`). Per peer
  the requester connects ``qps_per_peer`` RC QPs to as many responder QPs of
  the owner, through an ``OP_RDMA_CONNECT`` exchange
  (:mod:`kvpool.transfer.rdma_proto`) that the owner answers through a small
  connect listener of this transport whose endpoint travels in the segment
  descriptor.
- **Memory regions** (:mod:`~kvpool.transfer.transports.rdma_memory`). The
  owner registers each memory segment once (:meth:`describe_segment` returns
  the ``SegmentDescriptor.extra["rdma"]`` entry: address, rkey, length,
  connect endpoint; a peer without it asks in the connect request). Caller
  buffers marked registered are registered once and reused; every other
  buffer is staged through a pool of pre-registered host buffers.
- **Data path** (:mod:`~kvpool.transfer.transports.rdma_wr`). A sub-batch is
  planned into WRs, posted round-robin over the peer's QPs and completed by
  polling; a completion error fails its requests retryably (the engine fails
  them over to tcp) and drops the connection. A peer whose connects keep
  failing is skipped for ``cooldown_s``; the engine pauses the whole
  transport after ``pause_after_failures``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import zmq

from kvpool.core.config import ConfigError, parse_size
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.config import TransportSettings
from kvpool.transfer.rdma_proto import SegmentMr
from kvpool.transfer.rdma_verbs import MTU_BYTES, PyverbsVerbs, Verbs, VerbsDevice, VerbsError
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem
from kvpool.transfer.transports.rdma_connect import RdmaConnector, RdmaResponder
from kvpool.transfer.transports.rdma_memory import RdmaMemory
from kvpool.transfer.transports.rdma_wr import (
    PlannedSge,
    PlannedWr,
    WrPiece,
    WrRun,
    completion_error,
    plan_work_requests,
)
from kvpool.transfer.types import TransferError

__all__ = [
    "PlannedSge",
    "PlannedWr",
    "RdmaOptions",
    "RdmaTransport",
    "WrPiece",
    "completion_error",
    "plan_work_requests",
]

log = logging.getLogger(__name__)


@dataclass
class RdmaOptions:
    """``transports.rdma.options`` (see configs/transfer.yaml).

    ``devices``: device names in preference order ([] = the first one found).
    ``port``: HCA port number. ``gid_index``: GID table index (RoCE v2 is
    usually 1 or 3; ``show_gids`` lists them). ``mtu``: upper bound of the path
    MTU in bytes (the active MTUs of both ports also bound it). ``qp_depth``:
    WRs in flight per QP. ``max_wr_bytes``: largest WR (requests are split).
    ``max_sge``: SGEs gathered into one WR. ``qps_per_peer``: RC QPs per peer.
    ``connect_timeout_s``: QP-info exchange deadline. ``max_accepted``:
    responder connections kept (oldest closed beyond it). ``listen_host``:
    address of the connect listener (default: the transfer server's host).
    ``allow_with_capabilities``: RDMA is one-sided, so the per-request
    capability check of the transfer server (docs/security.md) cannot apply to it; while
    that server has a verifier set, this owner hands out no rkeys unless this
    is true (peers then use tcp, where every request is checked).
    """

    devices: list[str] = field(default_factory=list)
    port: int = 1
    gid_index: int = 0
    mtu: int = 4096
    qp_depth: int = 128
    max_wr_bytes: int | str = 1 << 20
    max_sge: int = 4
    qps_per_peer: int = 2
    connect_timeout_s: float = 2.0
    max_accepted: int = 256
    listen_host: str = ""
    allow_with_capabilities: bool = False

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> RdmaOptions:
        """Parse and validate; unknown keys or bad values raise ConfigError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"transports.rdma.options: unknown key(s) {unknown} "
                              f"(known: {sorted(known)})")
        o = cls(**options)
        if isinstance(o.devices, str):
            o.devices = [o.devices]
        if not isinstance(o.devices, list) or not all(isinstance(d, str) for d in o.devices):
            raise ConfigError("transports.rdma.options.devices: a list of device names")
        wr_bytes = parse_size(o.max_wr_bytes)
        o.max_wr_bytes = wr_bytes
        checks = [
            (1 <= o.port <= 255, "port must be in 1..255"),
            (0 <= o.gid_index <= 255, "gid_index must be in 0..255"),
            (o.mtu in MTU_BYTES.values(), f"mtu must be one of {sorted(MTU_BYTES.values())}"),
            (1 <= o.qp_depth <= 32768, "qp_depth must be in 1..32768"),
            (4096 <= wr_bytes <= 1 << 31, "max_wr_bytes must be in 4KiB..2GiB"),
            (1 <= o.max_sge <= 64, "max_sge must be in 1..64"),
            (1 <= o.qps_per_peer <= 16, "qps_per_peer must be in 1..16"),
            (o.connect_timeout_s > 0, "connect_timeout_s must be > 0"),
            (o.max_accepted >= 1, "max_accepted must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"transports.rdma.options: {msg}")
        return o


# -- the transport ----------------------------------------------------------------------


class RdmaTransport(Transport):
    """RDMA READ/WRITE to remote memory segments (see the module doc).

    ``verbs`` is the verbs layer (default: :class:`PyverbsVerbs`); tests pass
    a loopback double. ``cuda`` returns the CUDA runtime used to stage GPU
    buffers (default: :func:`kvpool.transfer.gpu.cuda_runtime`). ``options``
    come from ``settings.options``.
    """

    name = "rdma"

    def __init__(self, settings: TransportSettings | None = None,
                 verbs: Verbs | None = None,
                 cuda: Callable[[], tuple[Any, str]] | None = None) -> None:
        super().__init__(settings)
        self.options = RdmaOptions.from_options(dict(self.settings.options or {}))
        self.verbs: Verbs = verbs if verbs is not None else PyverbsVerbs()
        from kvpool.transfer.gpu import cuda_runtime

        self._lock = threading.Lock()
        self._dev: VerbsDevice | None = None
        self.port_mtu = 0  # the path MTU bound: the port's active MTU and options.mtu
        self._zctx: zmq.Context | None = None
        self.wr_ids = itertools.count(1)
        self.counters: dict[str, int] = {
            "connects": 0, "connect_failures": 0, "accepted": 0, "wrs_posted": 0,
            "bytes": 0, "staged_bytes": 0, "completion_errors": 0, "timeouts": 0,
        }
        #: segment, buffer and staging registrations
        self.memory = RdmaMemory(self.device, self.settings, self.counters,
                                 cuda if cuda is not None else cuda_runtime, id(self))
        #: the requester side: connections to peers
        self.connector = RdmaConnector(self)
        #: the owner side: connect requests of peers
        self.responder = RdmaResponder(self)

    # -- lifecycle --------------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        """Open the first configured (or found) device and query its port."""
        if self._dev is not None:
            return True, ""
        ok, reason = self.verbs.available()
        if not ok:
            return False, reason
        names = self.verbs.device_names()
        wanted = self.options.devices or names
        pick = [n for n in wanted if n in names]
        if not pick:
            return False, f"none of the configured RDMA devices {wanted} exists (found {names})"
        errors: list[str] = []
        for name in pick:
            try:
                dev = self.verbs.open(name, self.options.port, self.options.gid_index)
                info = dev.port_info()
            except VerbsError as exc:
                errors.append(f"{name}: {exc}")
                continue
            with self._lock:
                self._dev = dev
                self.port_mtu = min(info.mtu, self.options.mtu)
            log.info("rdma: using %s port %d (lid %d, gid %s, mtu %d)", name,
                     self.options.port, info.lid, info.gid, self.port_mtu)
            return True, ""
        return False, "; ".join(errors)

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        return kind == SegmentKind.MEMORY and device in ("cpu", "cuda")

    def stats(self) -> dict[str, Any]:
        self.memory.sweep()
        out: dict[str, Any] = dict(self.counters)
        out["peers"] = self.connector.stats()
        out["accepted_connections"] = self.responder.accepted_connections
        out.update(self.memory.stats())
        return out

    def close(self) -> None:
        """Close connections, responder QPs, MRs, the listener and the device."""
        if self.closed:
            return
        super().close()
        self.responder.close()
        self.connector.close()
        self.memory.close()
        with self._lock:
            dev, self._dev = self._dev, None
            zctx, self._zctx = self._zctx, None
        if dev is not None:
            dev.close()
        if zctx is not None:
            zctx.destroy(linger=0)

    def device(self) -> VerbsDevice:
        """The open device (TRANSPORT_UNAVAILABLE before :meth:`available` opened one)."""
        dev = self._dev
        if dev is None:
            raise TransferError("rdma device not open", ErrorCode.TRANSPORT_UNAVAILABLE)
        return dev

    def zmq_context(self) -> zmq.Context:
        """The ZeroMQ context of the connect exchange (created on first use)."""
        with self._lock:
            if self._zctx is None:
                self._zctx = zmq.Context()
            return self._zctx

    # -- segments and buffers -------------------------------------------------------------
    def describe_segment(self, seg: LocalSegment) -> dict[str, Any]:
        """Register ``seg`` (once) and return the entries to merge into its
        ``SegmentDescriptor.extra``: ``{"rdma": {"addr", "rkey", "len",
        "connect"}}`` (``connect`` "" = the descriptor's endpoint). {} for
        file segments and while capabilities are enforced (see RdmaOptions)."""
        if seg.kind != SegmentKind.MEMORY or self.responder.capabilities_enforced():
            return {}
        mr = self.memory.segment_mr(seg)
        info = SegmentMr(seg.segment_id, mr.addr, mr.rkey, seg.size)
        return {"rdma": info.to_extra(self.responder.connect_endpoint())}

    def handle_connect(self, hdr: dict[str, Any]) -> dict[str, Any]:
        """Serve one OP_RDMA_CONNECT request: see :meth:`RdmaResponder.handle_connect`."""
        return self.responder.handle_connect(hdr)

    def forget_segment(self, segment_id: str) -> None:
        """Drop cached remote registrations of the segment and, if we own it,
        deregister it (peers' later WRs fail and fail over)."""
        self.memory.forget_segment(segment_id)
        self.connector.forget_segment(segment_id)

    def register_buffer(self, handle: BufferHandle) -> bool:
        """See :meth:`RdmaMemory.register_buffer`."""
        return self.memory.register_buffer(handle)

    def unregister_buffer(self, handle: BufferHandle) -> None:
        """See :meth:`RdmaMemory.unregister_buffer`."""
        self.memory.unregister_buffer(handle)

    # -- execute --------------------------------------------------------------------------
    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        """Group by peer, connect if needed, plan, post and poll (module doc)."""
        if self.memory.buffers:
            self.memory.sweep()
        groups: dict[str, list[WorkItem]] = {}
        endpoint_of = self.connector.endpoint_of
        for it in items:
            ep = endpoint_of(it)
            if not ep:
                report(it, TransferError("segment has no endpoint to reach its owner",
                                         ErrorCode.TRANSPORT_UNAVAILABLE))
                continue
            groups.setdefault(ep, []).append(it)
        for ep, part in groups.items():
            if self.closed:
                err = TransferError("rdma transport closed", ErrorCode.CLOSED)
                for it in part:
                    report(it, err)
                continue
            self._execute_peer(ep, part, deadline, report)

    def _execute_peer(self, endpoint: str, items: list[WorkItem], deadline: float,
                      report: ReportFn) -> None:
        """One peer's items, on its connection (one sub-batch at a time)."""
        peer = self.connector.peer(endpoint)
        timeout = max(0.0, deadline - time.monotonic())
        if not peer.lock.acquire(timeout=timeout):
            err = TransferError(f"rdma connection to {endpoint} busy past the deadline",
                                ErrorCode.TIMEOUT)
            for it in items:
                report(it, err)
            return
        try:
            now = time.monotonic()
            if now < peer.down_until:
                err = TransferError(f"rdma peer {endpoint} down for another "
                                    f"{peer.down_until - now:.1f}s: {peer.last_error}",
                                    ErrorCode.TRANSPORT_UNAVAILABLE)
                for it in items:
                    report(it, err)
                return
            try:
                conn = self.connector.ensure(peer, endpoint, items, deadline)
            except TransferError as exc:
                for it in items:
                    report(it, exc)
                return
            WrRun(self, peer, conn, items, deadline, report).run()
        finally:
            peer.lock.release()

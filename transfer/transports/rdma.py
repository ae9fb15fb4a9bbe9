"""``rdma``: remote memory segments over RC queue pairs (RDMA READ/WRITE).

Not yet run on RDMA hardware: the data path is exercised against a loopback
test double of the verbs layer (tests/support/verbs_double.py); see
docs/rdma.md.

How it works:

- **Availability.** ``pyverbs`` is imported lazily; :meth:`RdmaTransport.available`
  is (False, reason) when it is missing or no device exists (pyverbs raises
  from ``get_device_list()`` then), and the engine skips the transport with one
  log line, so the selector's ``[rdma, tcp]`` rule falls through to tcp.
- **Connections.** Per peer (the segment owner's connect endpoint) the
  requester creates ``qps_per_peer`` RC QPs on one CQ and sends an
  ``OP_RDMA_CONNECT`` request (:mod:`kvpool.transfer.rdma_proto`) to the peer,
  which creates as many responder QPs, moves them INIT -> RTR -> RTS towards
  the requester's and replies with their QP number/PSN/LID/GID/MTU; the
  requester then moves its own QPs to RTS. The peer answers through its
  transfer server once that server routes ``OP_RDMA_CONNECT`` to
  :meth:`RdmaTransport.handle_connect` (``register_op_handler`` hook), else
  through a small connect listener of this transport whose endpoint travels in
  the segment descriptor.
- **Memory regions.** The owner registers each memory segment once
  (:meth:`describe_segment` returns the ``SegmentDescriptor.extra["rdma"]``
  entry: address, rkey, length, connect endpoint; a peer without it asks in the
  connect request). Caller buffers marked registered (``register_buffer``) are
  registered once and reused (GPU memory only where a peer-memory client makes
  ``ibv_reg_mr`` on device pointers work); every other buffer is staged
  through a pool of pre-registered host buffers.
- **Data path.** A sub-batch is planned into WRs (:func:`plan_work_requests`):
  requests split at ``max_wr_bytes``, adjacent requests whose remote ranges are
  contiguous gathered into one WR with up to ``max_sge`` SGEs. WRs are posted
  round-robin over the peer's QPs, at most ``qp_depth`` in flight per QP, all
  signalled, and the executing worker polls the CQ. A completion error
  (:func:`completion_error`) fails the requests of that WR with a retryable
  ``TransferError`` (the engine fails them over to tcp), moves the connection's
  QPs to ERR so the rest flush, and drops the connection; the next sub-batch
  reconnects. A peer whose connects keep failing is skipped for ``cooldown_s``;
  the engine pauses the whole transport after ``pause_after_failures``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import zmq

from kvpool.core.config import ConfigError, parse_size
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentKind, decode_frame, encode_frame
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.config import TransportSettings
from kvpool.transfer.rdma_proto import (
    MAX_SEGMENTS_PER_CONNECT,
    ConnectReply,
    ConnectRequest,
    QpInfo,
    SegmentMr,
)
from kvpool.transfer.rdma_verbs import (
    MTU_BYTES,
    Access,
    Completion,
    CompletionQueue,
    MemoryRegion,
    PyverbsVerbs,
    QueuePair,
    Sge,
    Verbs,
    VerbsDevice,
    VerbsError,
    WcStatus,
    WorkRequest,
    WrOp,
)
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem
from kvpool.transfer.types import TransferError, TransferOp

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

_POLL_BATCH = 64
_MR_KEY = "rdma_mr"


# -- options ------------------------------------------------------------------------


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
    address of the connect listener used when the transfer server has no
    ``register_op_handler`` hook (default: the transfer server's host).
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


# -- planning -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WrPiece:
    """One request as the planner sees it. ``local_addr``/``lkey`` are 0 for a
    staged request (its SGEs get a staging buffer at post time)."""

    key: int
    op: TransferOp
    remote_addr: int
    rkey: int
    length: int
    local_addr: int = 0
    lkey: int = 0
    staged: bool = False


@dataclass(frozen=True, slots=True)
class PlannedSge:
    """``length`` bytes at ``offset`` of request ``key`` (``addr`` = local address,
    0 when staged)."""

    key: int
    offset: int
    length: int
    addr: int
    lkey: int


@dataclass(slots=True)
class PlannedWr:
    """One WR: ``sges`` gather/scatter ``nbytes`` <-> ``remote_addr``; ``keys``
    are the requests it carries a part of (in order)."""

    op: TransferOp
    remote_addr: int
    rkey: int
    sges: list[PlannedSge]
    staged: bool = False
    keys: list[int] = field(default_factory=list)
    nbytes: int = 0

    @property
    def length(self) -> int:
        return self.nbytes


def plan_work_requests(pieces: Sequence[WrPiece], max_wr_bytes: int, max_sge: int,
                       staged_max_bytes: int | None = None) -> list[PlannedWr]:
    """Turn requests into RDMA work requests.

    Each request is split into chunks of at most ``max_wr_bytes`` (staged ones
    at ``staged_max_bytes``, the staging buffer size). Consecutive non-staged
    chunks of the same op and rkey whose remote ranges are contiguous are
    gathered into one WR of up to ``max_wr_bytes`` bytes: a chunk that is also
    locally contiguous with the previous one (same lkey) extends its SGE, any
    other takes a new SGE, up to ``max_sge`` (e.g. KV blocks scattered in local
    memory written to one remote object). Staged chunks always get a WR of
    their own (one staging buffer each). Zero-length requests produce no WR.
    """
    if max_wr_bytes <= 0 or max_sge <= 0:
        raise ValueError("max_wr_bytes and max_sge must be > 0")
    out: list[PlannedWr] = []
    for p in pieces:
        limit = min(max_wr_bytes, staged_max_bytes or max_wr_bytes) if p.staged \
            else max_wr_bytes
        off = 0
        while off < p.length:
            n = min(limit, p.length - off)
            raddr = p.remote_addr + off
            last = out[-1] if out else None
            if (not p.staged and last is not None and not last.staged and last.op == p.op
                    and last.rkey == p.rkey and last.remote_addr + last.nbytes == raddr
                    and last.nbytes + n <= max_wr_bytes):
                prev = last.sges[-1]
                addr = p.local_addr + off
                if prev.lkey == p.lkey and prev.addr + prev.length == addr:
                    # locally contiguous too: one longer SGE (it may span requests;
                    # only staged SGEs need their key/offset, and they never merge)
                    last.sges[-1] = PlannedSge(prev.key, prev.offset, prev.length + n,
                                               prev.addr, prev.lkey)
                elif len(last.sges) < max_sge:
                    last.sges.append(PlannedSge(p.key, off, n, addr, p.lkey))
                else:
                    last = None
                if last is not None:
                    last.nbytes += n
                    if last.keys[-1] != p.key:
                        last.keys.append(p.key)
                    off += n
                    continue
            sge = PlannedSge(p.key, off, n, 0 if p.staged else p.local_addr + off,
                             0 if p.staged else p.lkey)
            out.append(PlannedWr(p.op, raddr, p.rkey, [sge], p.staged, [p.key], n))
            off += n
    return out


def completion_error(c: Completion) -> TransferError:
    """The error a failed completion gives its requests. Always retryable: a
    flushed WR, a retry-exceeded link, a stale rkey (owner re-registered) or a
    remote fault are all things another transport (tcp) may get past."""
    name = WcStatus.name_of(c.status)
    code = ErrorCode.TIMEOUT if c.status in (WcStatus.RETRY_EXC_ERR,
                                             WcStatus.RESP_TIMEOUT_ERR) \
        else ErrorCode.TRANSFER_FAIL
    extra = f", vendor_err {c.vendor_err:#x}" if c.vendor_err else ""
    return TransferError(f"completion error {name}{extra}", code, retryable=True)


# -- client side: connections ---------------------------------------------------------


def _close_verbs(qps: Sequence[QueuePair], cq: CompletionQueue) -> None:
    """Close ``qps`` and then their CQ (the QPs must go first); a failure is
    logged and never raised, so one broken object does not leak the rest."""
    for qp in qps:
        try:
            qp.close()
        except Exception:
            log.debug("QP close failed", exc_info=True)
    try:
        cq.close()
    except Exception:
        log.debug("CQ close failed", exc_info=True)


class _Connection:
    """The requester end towards one peer: a CQ, N connected QPs and the
    peer's segment registrations learned so far."""

    def __init__(self, endpoint: str, cq: CompletionQueue, qps: list[QueuePair],
                 max_sge: int = 1) -> None:
        self.endpoint = endpoint
        self.cq = cq
        self.qps = qps
        self.max_sge = max_sge  # what the QPs were created with (device limit applied)
        self.segments: dict[str, SegmentMr] = {}
        self.broken = False

    def to_error(self) -> None:
        for qp in self.qps:
            try:
                qp.to_error()
            except VerbsError:
                log.debug("QP %d -> ERR failed", qp.qp_num, exc_info=True)

    def close(self) -> None:
        _close_verbs(self.qps, self.cq)
        self.qps = []


@dataclass
class _PeerState:
    """Per-peer bookkeeping; ``lock`` serialises sub-batches on one connection."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    conn: _Connection | None = None
    connect_failures: int = 0
    down_until: float = 0.0
    last_error: str = ""


@dataclass
class _Accepted:
    """The responder end of one requester connection."""

    cq: CompletionQueue
    qps: list[QueuePair]

    def close(self) -> None:
        _close_verbs(self.qps, self.cq)


class _Staging:
    """``count`` pre-registered host buffers of ``size`` bytes (one MR)."""

    def __init__(self, dev: VerbsDevice, count: int, size: int) -> None:
        self.size = size
        self.buf = np.zeros(count * size, dtype=np.uint8)
        self.mr = dev.reg_mr(int(self.buf.ctypes.data), self.buf.nbytes,
                             Access.LOCAL_WRITE)
        self._free = list(range(count))
        self._lock = threading.Lock()
        self.cuda_registered = False

    def try_acquire(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, i: int) -> None:
        with self._lock:
            self._free.append(i)

    def addr(self, i: int) -> int:
        return self.mr.addr + i * self.size

    def view(self, i: int, n: int) -> np.ndarray:
        return self.buf[i * self.size:i * self.size + n]

    def close(self) -> None:
        self.mr.close()


@dataclass(slots=True)
class _Inflight:
    wr: PlannedWr
    qp: int
    slot: int | None


class _ConnectListener:
    """Serves OP_RDMA_CONNECT on its own ROUTER socket for transfer servers
    without the ``register_op_handler`` hook."""

    def __init__(self, zctx: zmq.Context, host: str,
                 handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._sock = zctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvpool-rdma-connect:{port}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2 or len(frames[1]) > 4096:
                    reply: dict[str, Any] = {"id": None, "code": int(ErrorCode.MALFORMED_FRAME),
                                             "err": "expected one header frame <= 4 KiB"}
                else:
                    try:
                        hdr = decode_frame(frames[1])
                        reply = self._handler(hdr if isinstance(hdr, dict) else {})
                    except KVPoolError as exc:
                        reply = {"id": None, "code": int(exc.code), "err": str(exc)}
                self._sock.send_multipart([frames[0], encode_frame(reply)])
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                log.debug("rdma connect listener socket error", exc_info=True)
            except Exception:  # never die on one bad request
                log.exception("rdma connect listener: unexpected error")
        self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


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

        #: () -> (CUDA runtime | None, reason): copies GPU buffers to/from staging
        self._cuda_runtime: Callable[[], tuple[Any, str]] = \
            cuda if cuda is not None else cuda_runtime
        self._lock = threading.RLock()
        self._dev: VerbsDevice | None = None
        self._port_mtu = 0
        self._peers: dict[str, _PeerState] = {}
        self._accepted: OrderedDict[str, _Accepted] = OrderedDict()
        self._seg_mrs: dict[str, tuple[LocalSegment, MemoryRegion]] = {}
        #: id(handle) -> (weak handle, MR); swept when the handle is unregistered or gone
        self._buffer_mrs: dict[int, tuple[weakref.ref[BufferHandle], MemoryRegion]] = {}
        self._staging: _Staging | None = None
        self._zctx: zmq.Context | None = None
        self._listener: _ConnectListener | None = None
        self._server_hooked = False
        self._conn_prefix = uuid.uuid4().hex[:12]
        self._conn_ids = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._wr_ids = itertools.count(1)
        self.counters: dict[str, int] = {
            "connects": 0, "connect_failures": 0, "accepted": 0, "wrs_posted": 0,
            "bytes": 0, "staged_bytes": 0, "completion_errors": 0, "timeouts": 0,
        }

    # -- lifecycle --------------------------------------------------------------------
    def _hook_server(self) -> None:
        """Route OP_RDMA_CONNECT through the engine's transfer server when the
        server offers ``register_op_handler(op, fn)``."""
        server = getattr(self.ctx, "server", None)
        hook = getattr(server, "register_op_handler", None)
        if callable(hook) and not self._server_hooked:
            from kvpool.transfer.rdma_proto import OP_RDMA_CONNECT

            hook(OP_RDMA_CONNECT, self.handle_connect)
            self._server_hooked = True

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
                self._port_mtu = min(info.mtu, self.options.mtu)
            self._hook_server()
            log.info("rdma: using %s port %d (lid %d, gid %s, mtu %d)", name,
                     self.options.port, info.lid, info.gid, self._port_mtu)
            return True, ""
        return False, "; ".join(errors)

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        return kind == SegmentKind.MEMORY and device in ("cpu", "cuda")

    def stats(self) -> dict[str, Any]:
        self._sweep_buffers()
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["peers"] = {ep: {"connected": p.conn is not None,
                                 "connect_failures": p.connect_failures,
                                 "down_for_s": max(0.0, p.down_until - time.monotonic()),
                                 "last_error": p.last_error}
                            for ep, p in self._peers.items()}
            out["accepted_connections"] = len(self._accepted)
            out["registered_segments"] = len(self._seg_mrs)
            out["registered_buffers"] = len(self._buffer_mrs)
        return out

    def close(self) -> None:
        """Close connections, responder QPs, MRs, the listener and the device."""
        if self.closed:
            return
        super().close()
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
            accepted = list(self._accepted.values())
            self._accepted.clear()
            seg_mrs = [mr for _, mr in self._seg_mrs.values()]
            self._seg_mrs.clear()
            buf_mrs = [mr for _, mr in self._buffer_mrs.values()]
            self._buffer_mrs.clear()
            staging, self._staging = self._staging, None
            listener, self._listener = self._listener, None
            dev, self._dev = self._dev, None
        if listener is not None:
            listener.close()
        for p in peers:
            # a sub-batch still polling notices ``closed`` and lets go promptly
            got = p.lock.acquire(timeout=2.0)
            try:
                if p.conn is not None:
                    p.conn.close()
                    p.conn = None
            finally:
                if got:
                    p.lock.release()
        for a in accepted:
            a.close()
        for mr in seg_mrs + buf_mrs:
            mr.close()
        if staging is not None:
            staging.close()
        if dev is not None:
            dev.close()
        if self._zctx is not None:
            self._zctx.destroy(linger=0)
            self._zctx = None

    def _device(self) -> VerbsDevice:
        dev = self._dev
        if dev is None:
            raise TransferError("rdma device not open", ErrorCode.TRANSPORT_UNAVAILABLE)
        return dev

    def _zmq(self) -> zmq.Context:
        with self._lock:
            if self._zctx is None:
                self._zctx = zmq.Context()
            return self._zctx

    # -- owner side: segments and the connect handler -------------------------------------
    def _segment_mr(self, seg: LocalSegment) -> MemoryRegion:
        with self._lock:
            cached = self._seg_mrs.get(seg.segment_id)
            if cached is not None and cached[0] is seg:
                return cached[1]
            view = seg.view()
            if view is None:
                raise TransferError(f"segment {seg.segment_id!r} is not memory-mapped",
                                    ErrorCode.INVALID_PARAMS, retryable=False)
            addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
            access = Access.LOCAL_WRITE
            if TransferOp.READ in seg.allowed_ops:
                access |= Access.REMOTE_READ
            if TransferOp.WRITE in seg.allowed_ops:
                access |= Access.REMOTE_WRITE
            try:
                mr = self._device().reg_mr(addr, seg.size, access)
            except VerbsError as exc:
                raise TransferError(f"register segment {seg.segment_id!r}: {exc}",
                                    ErrorCode.TRANSFER_FAIL) from exc
            if cached is not None:
                cached[1].close()
            self._seg_mrs[seg.segment_id] = (seg, mr)
            return mr

    def _connect_endpoint(self) -> str:
        """"" when peers reach us through the transfer server, else our listener."""
        self._hook_server()
        if self._server_hooked:
            return ""
        with self._lock:
            if self._listener is None:
                server = getattr(self.ctx, "server", None)
                host = self.options.listen_host or getattr(server, "host", "") or "127.0.0.1"
                self._listener = _ConnectListener(self._zmq(), host, self.handle_connect)
            return self._listener.endpoint

    def _capabilities_enforced(self) -> bool:
        server = getattr(self.ctx, "server", None)
        return getattr(server, "verify_capability", None) is not None \
            and not self.options.allow_with_capabilities

    def describe_segment(self, seg: LocalSegment) -> dict[str, Any]:
        """Register ``seg`` (once) and return the entries to merge into its
        ``SegmentDescriptor.extra``: ``{"rdma": {"addr", "rkey", "len",
        "connect"}}`` (``connect`` "" = the descriptor's endpoint). {} for
        file segments and while capabilities are enforced (see RdmaOptions)."""
        if seg.kind != SegmentKind.MEMORY or self._capabilities_enforced():
            return {}
        mr = self._segment_mr(seg)
        info = SegmentMr(seg.segment_id, mr.addr, mr.rkey, seg.size)
        return {"rdma": info.to_extra(self._connect_endpoint())}

    def handle_connect(self, hdr: dict[str, Any]) -> dict[str, Any]:
        """Serve one OP_RDMA_CONNECT request (decoded header) and return the
        reply header. Never raises: errors become the reply's code/err."""
        rid = hdr.get("id") if isinstance(hdr.get("id"), int) else None
        try:
            req = ConnectRequest.from_wire(hdr)
            reply = self._accept(req)
        except KVPoolError as exc:
            log.info("rdma connect refused: %s", exc)
            return ConnectReply(0, exc.code, str(exc)).to_wire() | {"id": rid}
        except Exception as exc:
            log.exception("rdma connect failed")
            return ConnectReply(0, ErrorCode.INTERNAL_ERROR,
                                f"{type(exc).__name__}: {exc}").to_wire() | {"id": rid}
        return reply.to_wire()

    def _accept(self, req: ConnectRequest) -> ConnectReply:
        if self.closed:
            raise KVPoolError("rdma transport closed", ErrorCode.CLOSED)
        if self._capabilities_enforced():
            raise KVPoolError("capabilities are enforced here and RDMA cannot check them "
                              "per request; use tcp", ErrorCode.PERMISSION_DENIED)
        lookup = getattr(self.ctx, "local_segment", None)
        segs: list[SegmentMr] = []
        for sid in req.segments:
            seg = lookup(sid) if lookup is not None else None
            if seg is None or seg.kind != SegmentKind.MEMORY:
                raise KVPoolError(f"segment {sid!r} is not owned here",
                                  ErrorCode.SEGMENT_NOT_FOUND)
            mr = self._segment_mr(seg)
            segs.append(SegmentMr(sid, mr.addr, mr.rkey, seg.size))
        qps: list[QpInfo] = []
        if req.qps:
            dev = self._device()
            info = dev.port_info()
            depth = self.options.qp_depth
            cq = dev.create_cq(max(16, depth * len(req.qps)))
            mine: list[QueuePair] = []
            access = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
            try:
                for rq in req.qps:
                    qp = dev.create_qp(cq, depth, 1, access)
                    mine.append(qp)
                    qp.connect(rq.remote(), min(self._port_mtu, rq.mtu), dev.max_rd_atomic)
                    qps.append(QpInfo(qp.qp_num, qp.psn, info.lid, info.gid, self._port_mtu))
            except VerbsError as exc:
                _Accepted(cq, mine).close()
                raise KVPoolError(f"responder QP setup: {exc}", ErrorCode.TRANSFER_FAIL) \
                    from exc
            key = f"{req.host}/{req.conn}"
            with self._lock:
                old = self._accepted.pop(key, None)
                self._accepted[key] = _Accepted(cq, mine)
                evicted = []
                while len(self._accepted) > self.options.max_accepted:
                    evicted.append(self._accepted.popitem(last=False)[1])
                self.counters["accepted"] += 1
            for a in ([old] if old else []) + evicted:
                a.close()
        return ConnectReply(req.id, ErrorCode.OK, "", qps, segs)

    def forget_segment(self, segment_id: str) -> None:
        """Drop cached remote registrations of the segment and, if we own it,
        deregister it (peers' later WRs fail and fail over)."""
        with self._lock:
            owned = self._seg_mrs.pop(segment_id, None)
            peers = list(self._peers.values())
        if owned is not None:
            owned[1].close()
        for p in peers:
            conn = p.conn
            if conn is not None:
                conn.segments.pop(segment_id, None)

    # -- caller buffers -------------------------------------------------------------------
    def register_buffer(self, handle: BufferHandle) -> bool:
        """Register a caller buffer once (host memory; GPU memory only where
        the driver accepts device pointers, e.g. nvidia-peermem). Returns
        whether it is registered; unregistered buffers are staged."""
        key = f"{_MR_KEY}:{id(self)}"
        if key in handle.cache:
            return handle.cache[key] is not None
        mr: MemoryRegion | None = None
        try:
            mr = self._device().reg_mr(handle.ptr, handle.length,
                                       Access.LOCAL_WRITE | Access.REMOTE_READ
                                       | Access.REMOTE_WRITE)
        except (VerbsError, TransferError) as exc:
            log.info("rdma: buffer of %d bytes (%s) not registrable, staging it: %s",
                     handle.length, handle.device, exc)
        handle.cache[key] = mr
        self._sweep_buffers()
        if mr is not None:
            with self._lock:
                self._buffer_mrs[id(handle)] = (weakref.ref(handle), mr)
        return mr is not None

    def _sweep_buffers(self) -> None:
        """Deregister MRs of buffers the engine unregistered (``registered``
        cleared) or that no longer exist."""
        with self._lock:
            dead = [k for k, (ref, _) in self._buffer_mrs.items()
                    if (h := ref()) is None or not h.registered]
            mrs = [self._buffer_mrs.pop(k)[1] for k in dead]
        for mr in mrs:
            mr.close()

    def unregister_buffer(self, handle: BufferHandle) -> None:
        """Deregister a buffer registered by :meth:`register_buffer`."""
        mr = handle.cache.pop(f"{_MR_KEY}:{id(self)}", None)
        with self._lock:
            self._buffer_mrs.pop(id(handle), None)
        if mr is not None:
            mr.close()
        self._sweep_buffers()

    def _local_mr(self, handle: BufferHandle) -> MemoryRegion | None:
        if not handle.registered:
            return None
        key = f"{_MR_KEY}:{id(self)}"
        if key not in handle.cache:
            self.register_buffer(handle)
        mr = handle.cache.get(key)
        return mr if isinstance(mr, MemoryRegion) else None

    def _staging_pool(self) -> _Staging:
        with self._lock:
            if self._staging is None:
                try:
                    self._staging = _Staging(self._device(), self.settings.staging_buffers,
                                             self.settings.staging_bytes)
                except VerbsError as exc:
                    raise TransferError(f"register staging buffers: {exc}",
                                        ErrorCode.TRANSFER_FAIL) from exc
            return self._staging

    # -- client side: connecting ----------------------------------------------------------
    def _exchange(self, endpoint: str, req: ConnectRequest, deadline: float) -> ConnectReply:
        req.id = next(self._req_ids)
        timeout = min(self.options.connect_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            raise TransferError("deadline passed before connecting", ErrorCode.TIMEOUT)
        sock = self._zmq().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(encode_frame(req.to_wire()))
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise TransferError(f"no rdma connect reply from {endpoint} in {timeout:.1f}s",
                                    ErrorCode.TIMEOUT)
            frames = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        try:
            reply = ConnectReply.from_wire(decode_frame(frames[0]))
        except KVPoolError as exc:
            raise TransferError(f"bad rdma connect reply from {endpoint}: {exc}",
                                exc.code) from exc
        if reply.code != ErrorCode.OK:
            hint = " (peer's transfer server has no rdma connect hook)" \
                if reply.code == ErrorCode.UNKNOWN_OP else ""
            raise TransferError(f"rdma connect refused by {endpoint}: "
                                f"{reply.code.name} {reply.err}{hint}", reply.code)
        return reply

    def _connect(self, endpoint: str, segment_ids: list[str], deadline: float) -> _Connection:
        dev = self._device()
        info = dev.port_info()
        n = self.options.qps_per_peer
        depth = self.options.qp_depth
        max_sge = max(1, min(self.options.max_sge, dev.max_sge))
        cq = dev.create_cq(max(16, depth * n))
        qps: list[QueuePair] = []
        conn = _Connection(endpoint, cq, qps, max_sge)
        try:
            access = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
            for _ in range(n):
                qps.append(dev.create_qp(cq, depth, max_sge, access))
            host = getattr(self.ctx, "host_id", "") or ""
            req = ConnectRequest(f"{self._conn_prefix}-{next(self._conn_ids)}", host,
                                 [QpInfo(q.qp_num, q.psn, info.lid, info.gid, self._port_mtu)
                                  for q in qps], segment_ids[:MAX_SEGMENTS_PER_CONNECT])
            reply = self._exchange(endpoint, req, deadline)
            if len(reply.qps) != len(qps):
                raise TransferError(f"peer answered {len(reply.qps)} QPs for {len(qps)}",
                                    ErrorCode.MALFORMED_FRAME)
            for qp, rq in zip(qps, reply.qps, strict=True):
                qp.connect(rq.remote(), min(self._port_mtu, rq.mtu), dev.max_rd_atomic)
            conn.segments.update({s.segment_id: s for s in reply.segments})
        except VerbsError as exc:
            conn.close()
            raise TransferError(f"rdma connect to {endpoint}: {exc}",
                                ErrorCode.TRANSFER_FAIL) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _peer_endpoint(self, item: WorkItem) -> str:
        extra = item.segment.extra.get("rdma") if isinstance(item.segment.extra, dict) else None
        ep = extra.get("connect") if isinstance(extra, dict) else None
        return str(ep) if ep else item.segment.endpoint

    # -- execute --------------------------------------------------------------------------
    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        """Group by peer, connect if needed, plan, post and poll (module doc)."""
        if self._buffer_mrs:
            self._sweep_buffers()
        groups: dict[str, list[WorkItem]] = {}
        for it in items:
            ep = self._peer_endpoint(it)
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

    def _peer(self, endpoint: str) -> _PeerState:
        with self._lock:
            p = self._peers.get(endpoint)
            if p is None:
                p = self._peers[endpoint] = _PeerState()
            return p

    def _execute_peer(self, endpoint: str, items: list[WorkItem], deadline: float,
                      report: ReportFn) -> None:
        peer = self._peer(endpoint)
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
                conn = self._ensure_connection(peer, endpoint, items, deadline)
            except TransferError as exc:
                for it in items:
                    report(it, exc)
                return
            self._run(peer, conn, items, deadline, report)
        finally:
            peer.lock.release()

    def _ensure_connection(self, peer: _PeerState, endpoint: str, items: list[WorkItem],
                           deadline: float) -> _Connection:
        wanted = sorted({it.segment.segment_id for it in items})
        conn = peer.conn
        try:
            if conn is None:
                missing = [s for s in wanted if not self._extra_mr(s, items)]
                conn = self._connect(endpoint, missing, deadline)
                peer.conn = conn
                self.counters["connects"] += 1
            for sid in wanted:  # learn what the descriptors carry
                if sid not in conn.segments:
                    mr = self._extra_mr(sid, items)
                    if mr is not None:
                        conn.segments[sid] = mr
            missing = [s for s in wanted if s not in conn.segments]
            if missing:
                reply = self._exchange(endpoint, ConnectRequest(
                    f"{self._conn_prefix}-q", getattr(self.ctx, "host_id", "") or "", [],
                    missing[:MAX_SEGMENTS_PER_CONNECT]), deadline)
                conn.segments.update({s.segment_id: s for s in reply.segments})
        except TransferError as exc:
            self.counters["connect_failures"] += 1
            peer.connect_failures += 1
            peer.last_error = str(exc)
            if peer.connect_failures >= self.settings.pause_after_failures:
                peer.down_until = time.monotonic() + self.settings.cooldown_s
                peer.connect_failures = 0
                log.warning("rdma peer %s skipped for %.1fs after repeated connect failures: "
                            "%s", endpoint, self.settings.cooldown_s, exc)
            raise
        peer.connect_failures = 0
        return conn

    @staticmethod
    def _extra_mr(segment_id: str, items: list[WorkItem]) -> SegmentMr | None:
        for it in items:
            if it.segment.segment_id == segment_id:
                extra = it.segment.extra.get("rdma") if isinstance(it.segment.extra, dict) \
                    else None
                if isinstance(extra, dict) and "rkey" in extra:
                    try:
                        return SegmentMr.from_extra(segment_id, extra)
                    except KVPoolError:
                        log.warning("segment %s: bad extra['rdma'] %r", segment_id, extra)
                return None
        return None

    def _drop(self, peer: _PeerState, conn: _Connection) -> None:
        conn.close()
        if peer.conn is conn:
            peer.conn = None

    def _run(self, peer: _PeerState, conn: _Connection, items: list[WorkItem],
             deadline: float, report: ReportFn) -> None:
        """Move ``items`` over ``conn``: see :class:`_WrRun` for the steps."""
        _WrRun(self, peer, conn, items, deadline, report).run()

    # -- staging copies -------------------------------------------------------------------
    def _stage_in(self, item: WorkItem, sge: PlannedSge, dst: np.ndarray) -> None:
        """Copy the request's bytes at ``sge.offset`` into the staging buffer."""
        start = item.buffer_offset + sge.offset
        self.counters["staged_bytes"] += sge.length
        if item.buffer.is_gpu:
            self._cuda().memcpy(int(dst.ctypes.data), item.buffer.ptr + start, sge.length)
        else:
            dst[:] = item.buffer.host_view(start, sge.length)

    def _stage_out(self, item: WorkItem, sge: PlannedSge, src: np.ndarray) -> None:
        start = item.buffer_offset + sge.offset
        self.counters["staged_bytes"] += sge.length
        if item.buffer.is_gpu:
            self._cuda().memcpy(item.buffer.ptr + start, int(src.ctypes.data), sge.length)
        else:
            item.buffer.host_view(start, sge.length)[:] = src

    def _cuda(self) -> Any:
        rt, reason = self._cuda_runtime()
        if rt is None:
            raise TransferError(f"GPU buffer but {reason}", ErrorCode.TRANSPORT_UNAVAILABLE,
                                retryable=False)
        staging = self._staging
        if staging is not None and not staging.cuda_registered:
            try:  # page-lock for CUDA too so the copies are direct DMA
                rt.host_register(int(staging.buf.ctypes.data), staging.buf.nbytes)
                staging.cuda_registered = True
            except TransferError:
                log.debug("cudaHostRegister of the rdma staging pool failed", exc_info=True)
        return rt


class _WrRun:
    """One sub-batch to one peer over RDMA, in named steps.

    :meth:`_plan` turns the items into WRs (:func:`plan_work_requests`; an
    item without a usable registration fails at once), then :meth:`run`
    loops: :meth:`_post` posts WRs up to each QP's depth and the staging
    pool's free buffers, :meth:`_poll` takes completions (a completion error
    moves the QPs to ERR so the rest flush, and fails its requests
    retryably), :meth:`_expire` gives up at the deadline (destroying the QPs
    guarantees no late DMA into the buffers), and :meth:`_settle` reports
    what was never posted or finished. Every item is reported exactly once.
    """

    def __init__(self, rdma: RdmaTransport, peer: _PeerState, conn: _Connection,
                 items: list[WorkItem], deadline: float, report: ReportFn) -> None:
        self.rdma = rdma
        self.peer = peer
        self.conn = conn
        self.deadline = deadline
        self.report = report
        self.by_key: dict[int, WorkItem] = dict(enumerate(items))
        self.pending: dict[int, int] = {}  # item key -> WRs not yet completed
        self.done: set[int] = set()
        self.plan: list[PlannedWr] = []
        self.staging: _Staging | None = None
        self.inflight: dict[int, _Inflight] = {}
        self.per_qp = [0] * len(conn.qps)
        self.broken: TransferError | None = None
        self.nxt = 0  # next WR of the plan to post

    def finish(self, key: int, err: TransferError | None) -> None:
        if key in self.done:
            return
        self.done.add(key)
        self.report(self.by_key[key], err)

    # -- steps ------------------------------------------------------------------------
    def _plan(self) -> None:
        pieces: list[WrPiece] = []
        for key, it in self.by_key.items():
            seg = self.conn.segments.get(it.segment.segment_id)
            if seg is None:
                self.finish(key, TransferError(f"no rdma registration for segment "
                                               f"{it.segment.segment_id!r}",
                                               ErrorCode.TRANSFER_FAIL))
                continue
            if it.offset + it.length > seg.length:
                self.finish(key, TransferError(
                    f"segment {seg.segment_id!r} registration covers {seg.length} bytes, "
                    f"request ends at {it.offset + it.length}", ErrorCode.SEGMENT_MISMATCH))
                continue
            mr = self.rdma._local_mr(it.buffer)
            if mr is not None:
                pieces.append(WrPiece(key, it.op, seg.addr + it.offset, seg.rkey, it.length,
                                      it.buffer.ptr + it.buffer_offset, mr.lkey))
            else:
                pieces.append(WrPiece(key, it.op, seg.addr + it.offset, seg.rkey, it.length,
                                      staged=True))
        if any(p.staged for p in pieces):
            self.staging = self.rdma._staging_pool()
        self.plan = plan_work_requests(pieces, int(self.rdma.options.max_wr_bytes),
                                       self.conn.max_sge,
                                       self.staging.size if self.staging is not None else None)
        for pw in self.plan:
            for k in pw.keys:
                self.pending[k] = self.pending.get(k, 0) + 1

    def run(self) -> None:
        self._plan()
        idle_polls = 0
        while True:
            self._post()
            if not self.inflight:
                if self.broken is not None or self.nxt >= len(self.plan):
                    break
                # blocked on the staging pool (shared with other sub-batches)
                if time.monotonic() >= self.deadline:
                    self.broken = TransferError("rdma: no free staging buffer before the "
                                                "deadline", ErrorCode.TIMEOUT)
                    break
                time.sleep(0.0002)
                continue
            if self._poll():
                idle_polls = 0
                continue
            if self.rdma.closed or time.monotonic() >= self.deadline:
                self._expire()
                break
            idle_polls += 1
            if idle_polls > 64:
                time.sleep(0.00005)
        self._settle()

    def _post(self) -> None:
        """Post WRs while a QP has room (and, for staged WRs, a buffer is free)."""
        conn, staging, rdma = self.conn, self.staging, self.rdma
        depth = rdma.options.qp_depth
        while self.broken is None and self.nxt < len(self.plan):
            qi = min(range(len(self.per_qp)), key=self.per_qp.__getitem__)
            if self.per_qp[qi] >= depth:
                return
            pw = self.plan[self.nxt]
            slot = None
            if pw.staged:
                assert staging is not None
                slot = staging.try_acquire()
                if slot is None:
                    return
                try:
                    sges = [Sge(staging.addr(slot), pw.length, staging.mr.lkey)]
                    if pw.op == TransferOp.WRITE:
                        rdma._stage_in(self.by_key[pw.sges[0].key], pw.sges[0],
                                       staging.view(slot, pw.length))
                except TransferError as exc:
                    staging.release(slot)
                    for k in pw.keys:
                        self.finish(k, exc)
                    self.nxt += 1
                    continue
            else:
                sges = [Sge(sg.addr, sg.length, sg.lkey) for sg in pw.sges]
            wr_id = next(rdma._wr_ids)
            wr = WorkRequest(wr_id, WrOp.RDMA_WRITE if pw.op == TransferOp.WRITE
                             else WrOp.RDMA_READ, sges, pw.remote_addr, pw.rkey)
            try:
                conn.qps[qi].post_send([wr])
            except VerbsError as exc:
                if slot is not None and staging is not None:
                    staging.release(slot)
                self.broken = TransferError(f"post_send: {exc}", ErrorCode.TRANSFER_FAIL)
                return
            self.inflight[wr_id] = _Inflight(pw, qi, slot)
            self.per_qp[qi] += 1
            self.nxt += 1
            rdma.counters["wrs_posted"] += 1

    def _poll(self) -> bool:
        """Handle the completions that arrived; False when none did."""
        staging, rdma = self.staging, self.rdma
        comps = self.conn.cq.poll(_POLL_BATCH)
        for c in comps:
            fl = self.inflight.pop(c.wr_id, None)
            if fl is None:
                log.warning("rdma: completion for unknown wr_id %d", c.wr_id)
                continue
            self.per_qp[fl.qp] -= 1
            err: TransferError | None = None
            if c.ok:
                rdma.counters["bytes"] += fl.wr.length
                if fl.slot is not None and fl.wr.op == TransferOp.READ and staging:
                    try:
                        rdma._stage_out(self.by_key[fl.wr.sges[0].key], fl.wr.sges[0],
                                        staging.view(fl.slot, fl.wr.length))
                    except TransferError as exc:
                        err = exc
            else:
                rdma.counters["completion_errors"] += 1
                err = completion_error(c)
                if self.broken is None:
                    self.broken = err
                    log.warning("rdma: %s on a WR to %s; failing its requests over",
                                err, self.conn.endpoint)
                    self.conn.to_error()  # flush the rest instead of waiting them out
            if fl.slot is not None and staging is not None:
                staging.release(fl.slot)
            for k in fl.wr.keys:
                if err is not None:
                    self.finish(k, err)
                else:
                    self.pending[k] -= 1
                    if self.pending[k] == 0:
                        self.finish(k, None)
        return bool(comps)

    def _expire(self) -> None:
        """The deadline passed (or the transport closed) with WRs in flight."""
        rdma = self.rdma
        rdma.counters["timeouts"] += 1
        err = TransferError(f"rdma: {len(self.inflight)} WRs to {self.conn.endpoint} not "
                            "completed by the deadline", ErrorCode.TIMEOUT) \
            if not rdma.closed else TransferError("rdma transport closed", ErrorCode.CLOSED)
        # destroying the QPs guarantees no late DMA into the buffers
        self.conn.to_error()
        rdma._drop(self.peer, self.conn)
        for fl in self.inflight.values():
            for k in fl.wr.keys:
                self.finish(k, err)
        self.inflight.clear()
        self.broken = self.broken or err

    def _settle(self) -> None:
        """Report every item not reported yet; drop a broken connection."""
        if self.broken is not None:
            for k in self.by_key:
                self.finish(k, self.broken)  # requests never posted
            self.rdma._drop(self.peer, self.conn)
        else:
            for k in self.by_key:
                if k not in self.done:  # e.g. a zero-length remainder
                    self.finish(k, None if self.pending.get(k, 0) == 0 else TransferError(
                        "request left unfinished", ErrorCode.TRANSFER_FAIL))

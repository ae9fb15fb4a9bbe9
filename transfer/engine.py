"""TransferEngine: batches -> per-transport sub-batches with failover.

``submit()`` resolves each request (buffer, segment, bounds), asks the
selector for its ordered transport list, and groups requests by the first
usable transport into **sub-batches**. A sub-batch runs on its transport's own
worker pool (``threads`` slices in parallel) with its own state machine
(PENDING -> RUNNING -> DONE | FAILED), progress counters and error, so one
slow or failing transport never blocks another's requests. A request that
fails retryably is retried on the same transport (``retries``), then
re-planned onto the next transport its rule allows (up to ``max_failover``);
a transport whose attempts keep failing is paused for ``cooldown_s``. Health
is kept per (transport, peer): a dead peer pauses tcp towards that peer only,
while a transport that is broken everywhere gets paused for every peer.
``run``/``transfer`` of a lone request make its first attempt on the caller's
thread without building the batch (handle, sub-batch, reports); a failed
attempt is handed to the batch path, which goes on from there as above. So do
they for a batch of requests alike (one segment, registered buffers of one
device, one length, one slice: the pages of a KV batch), without the
per-request tracks and statuses until something in the attempt fails.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvpool.core.auth import CurveConfig
from kvpool.core.capability import CapabilityVerifier
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.buffers import BufferHandle, as_buffer
from kvpool.transfer.config import RuleConfig, TransferConfig, TransportSettings
from kvpool.transfer.gpu import copies_independent
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.segment_server import SegmentServer
from kvpool.transfer.transports import load_transport_class
from kvpool.transfer.transports.base import Transport, WorkItem
from kvpool.transfer.types import (
    RequestState,
    RequestStatus,
    TransferError,
    TransferOp,
    TransferRequest,
)

__all__ = ["BatchHandle", "SubBatch", "SubBatchState", "TransferEngine"]

log = logging.getLogger(__name__)
_PENDING, _RUNNING = RequestState.PENDING, RequestState.RUNNING
_DONE, _FAILED = RequestState.DONE, RequestState.FAILED
_OK = ErrorCode.OK
_UNREPORTED = object()  # _run_batch: a request the transport has not reported yet

_RULE_CACHE = 4096  # (segment kind, same host, device, size) -> selector rule, remembered
#: a sub-batch is split across a transport's threads only in slices of at least this
#: many bytes (below it one thread finishes sooner than two threads start)
_MIN_SLICE_BYTES = 4 << 20


class SubBatchState(Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # at least one of its requests failed on this transport


@dataclass(eq=False)
class SubBatch:
    """The requests of one batch that one transport serves in one attempt."""

    id: int
    transport: str
    items: list[WorkItem]
    state: SubBatchState = SubBatchState.PENDING
    done: int = 0
    failed: int = 0
    error: str = ""
    started: float = 0.0
    finished: float = 0.0
    _slices_left: int = 0
    _failures: list[tuple[WorkItem, TransferError]] = field(default_factory=list)
    _reported: set[int] = field(default_factory=set)


class _Track:
    """Per-request bookkeeping inside a batch. ``candidates`` is shared with the
    selector rule (read only); ``attempts`` is made on the first failure."""

    __slots__ = ("attempts", "candidates", "failovers", "status", "tried")

    def __init__(self) -> None:
        self.status = RequestStatus(_PENDING, None, _OK, [])
        self.candidates: Sequence[str] = ()
        self.tried: list[str] = []
        self.attempts: dict[str, int] | None = None
        self.failovers = 0


class BatchHandle:
    """Handle of a submitted batch. ``wait``/``status``/``ok``; ``sub_batches``
    lists every sub-batch attempt (for inspection and tests)."""

    def __init__(self, n: int) -> None:
        # the condition's own lock, entered directly on hot paths (a C-level
        # context manager; Condition.__enter__ is a Python call per use)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._tracks = [_Track() for _ in range(n)]
        self._remaining = n
        self.sub_batches: list[SubBatch] = []

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every request is DONE or FAILED; False on timeout."""
        with self._lock:
            if self._remaining == 0:  # an inline batch: finished before anyone waits
                return True
            return self._cond.wait_for(lambda: self._remaining == 0, timeout)

    def status(self) -> list[RequestStatus]:
        """A snapshot (copies) of every request's status, in request order."""
        with self._lock:
            return [
                RequestStatus(t.status.state, t.status.transport, t.status.code,
                              list(t.status.errors))
                for t in self._tracks
            ]

    @property
    def done(self) -> bool:
        with self._lock:
            return self._remaining == 0

    @property
    def ok(self) -> bool:
        with self._lock:
            return all(t.status.state is RequestState.DONE for t in self._tracks)

    # -- engine side ------------------------------------------------------------
    def _finish(self, idx: int, state: RequestState, transport: str | None,
                code: ErrorCode = ErrorCode.OK, error: str | None = None) -> None:
        with self._lock:
            self._finish_locked(idx, state, transport, code, error)

    def _finish_locked(self, idx: int, state: RequestState, transport: str | None,
                       code: ErrorCode = ErrorCode.OK, error: str | None = None) -> None:
        st = self._tracks[idx].status
        if st.state is _DONE or st.state is _FAILED:
            return
        st.state = state
        st.transport = transport
        st.code = code
        if error:
            st.errors.append(error)
        self._remaining -= 1
        if self._remaining == 0:
            self._cond.notify_all()


class _TransportSlot:
    """A loaded transport plus its pool and health state."""

    def __init__(self, transport: Transport, settings: TransportSettings) -> None:
        self.transport = transport
        self.settings = settings
        self.pool = ThreadPoolExecutor(max_workers=settings.threads,
                                       thread_name_prefix=f"kvpool-xfer-{transport.name}")
        # peer key -> [consecutive failed attempts, paused until (monotonic)]
        self.health: dict[str, list[float]] = {}

    def paused(self, peer: str) -> bool:
        h = self.health.get(peer)
        return h is not None and time.monotonic() < h[1]


def _peer_key(item: WorkItem) -> str:
    """Whom a request depends on besides the transport: the segment's owner."""
    seg = item.segment
    return seg.endpoint or f"{seg.host_id}/{seg.client_id}"


class TransferEngine:
    """Moves bytes between caller buffers and segments (local, same-host or remote).

    Starts this process's transfer server (unless ``config.server.enabled`` is
    false) and loads every enabled transport. See docs/INTERFACES.md.
    """

    def __init__(self, config: TransferConfig, host_id: str, bind_host: str = "127.0.0.1",
                 port: int = 0, client_id: str = "", curve: CurveConfig | None = None) -> None:
        self.config = config
        #: CURVE policy for the server socket and the tcp transport's client sockets
        self.curve = curve
        self._host_id = host_id
        self.client_id = client_id
        self._lock = threading.RLock()
        self._local: dict[str, LocalSegment] = {}
        self._peers: dict[str, SegmentDescriptor] = {}
        self._slots: dict[str, _TransportSlot] = {}
        self._unavailable: dict[str, str] = {}
        self._sb_ids = itertools.count(1)
        self._rule_cache: dict[tuple[SegmentKind, bool, str, int], RuleConfig | None] = {}
        self._gpu_in_use = False  # a GPU buffer was registered: prepare segments for it
        self._warm_pool: ThreadPoolExecutor | None = None
        self._warm_futures: list[Future[None]] = []
        self._closed = False
        #: serves the local segments to peers and checks their capabilities
        self.segment_server = SegmentServer(self.local_segment, config.server, bind_host, port,
                                            curve=curve, tcp_congestion=config.tcp_congestion)
        try:
            self._load_transports()
        except BaseException:
            self.segment_server.close()
            raise

    # -- EngineContext ----------------------------------------------------------
    @property
    def host_id(self) -> str:
        return self._host_id

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` of this process's transfer server ("" if disabled)."""
        return self.segment_server.endpoint

    @property
    def server(self) -> SegmentServer | None:
        """The segment server while it serves (None with ``server.enabled`` false)."""
        return self.segment_server if self.segment_server.serving else None

    @property
    def capabilities(self) -> CapabilityVerifier:
        """The capability verifier of the local segments (the segment server's)."""
        return self.segment_server.capabilities

    @property
    def tcp_congestion(self) -> str:
        """The congestion-control policy of this process's bulk sockets."""
        return self.config.tcp_congestion

    def local_segment(self, segment_id: str) -> LocalSegment | None:
        return self._local.get(segment_id)

    # -- capabilities (docs/security.md) ------------------------------------------------
    def set_capability_key(self, segment_id: str, key: bytes) -> None:
        """See :meth:`SegmentServer.set_capability_key`."""
        self.segment_server.set_capability_key(segment_id, key)

    def remove_capability_key(self, segment_id: str) -> None:
        self.segment_server.remove_capability_key(segment_id)

    def observe_master_epoch(self, epoch: int) -> None:
        """See :meth:`SegmentServer.observe_master_epoch`."""
        self.segment_server.observe_master_epoch(epoch)

    def capability_stats(self) -> dict[str, Any]:
        """See :meth:`SegmentServer.capability_stats`."""
        return self.segment_server.capability_stats()

    # -- transports -------------------------------------------------------------
    def _load_transports(self) -> None:
        from kvpool.core.config import ConfigError

        names: list[str] = []
        for rule in self.config.rules:
            names += [t for t in rule.transports if t not in names]
        names += [t for t in self.config.transports if t not in names]
        for name in names:
            settings = self.config.settings_for(name)
            if settings.enabled is False:
                self._unavailable[name] = "disabled in config"
                continue
            cls, reason = load_transport_class(name)
            transport = cls(settings) if cls is not None else None
            if transport is not None:
                transport.attach(self)
                ok, reason = transport.available()
                if not ok:
                    transport.close()
                    transport = None
            if transport is None:
                if settings.enabled is True:
                    raise ConfigError(f"transport {name} is enabled: true but unavailable: "
                                      f"{reason}")
                self._unavailable[name] = reason
                log.info("transport %s skipped: %s", name, reason)
                continue
            self._slots[name] = _TransportSlot(transport, settings)

    def register_transport(self, transport: Transport,
                           settings: TransportSettings | None = None) -> None:
        """Add (or replace) a transport instance under ``transport.name``; the
        selector uses it wherever a rule or hint names it."""
        transport.attach(self)
        ok, reason = transport.available()
        if not ok:
            raise TransferError(f"transport {transport.name} unavailable: {reason}",
                                ErrorCode.TRANSPORT_UNAVAILABLE, retryable=False)
        with self._lock:
            old = self._slots.pop(transport.name, None)
            self._slots[transport.name] = _TransportSlot(
                transport, settings or transport.settings)
            self._unavailable.pop(transport.name, None)
        if old is not None:
            old.pool.shutdown(wait=False)
            old.transport.close()

    def transports(self) -> dict[str, tuple[bool, str]]:
        """name -> (usable, reason) for every transport the config mentions."""
        out: dict[str, tuple[bool, str]] = {n: (True, "") for n in self._slots}
        out.update({n: (False, r) for n, r in self._unavailable.items()})
        return out

    def transport(self, name: str) -> Transport | None:
        slot = self._slots.get(name)
        return slot.transport if slot else None

    # -- segments and buffers ---------------------------------------------------
    def add_local_segment(self, segment: LocalSegment) -> SegmentDescriptor:
        """Serve ``segment`` (owned by this process) and make it addressable by id.
        Returns the descriptor to publish (the master hands it to peers): with
        :meth:`describe_extra`'s entries."""
        with self._lock:
            if segment.segment_id in self._local and self._local[segment.segment_id] is not segment:
                raise TransferError(f"segment {segment.segment_id!r} already added",
                                    ErrorCode.SEGMENT_ALREADY_EXISTS, retryable=False)
            self._local[segment.segment_id] = segment
        desc = segment.descriptor(self.client_id, self._host_id, self.endpoint)
        desc.extra.update(self.describe_extra(segment))
        self._warm_gpu(desc, segment)
        return desc

    def describe_extra(self, segment: LocalSegment) -> dict[str, Any]:
        """What this process adds to ``segment``'s descriptor ``extra`` for its
        peers: the transfer server's bulk offer for a memory segment (a peer's
        first tcp request then goes straight to the bulk socket, instead of
        over ZeroMQ while it asks for the port)."""
        if segment.kind != SegmentKind.MEMORY:
            return {}
        return self.segment_server.bulk_extra()

    def remove_local_segment(self, segment_id: str) -> None:
        """Stop serving the segment (the caller still owns and closes it)."""
        with self._lock:
            self._local.pop(segment_id, None)
        self.segment_server.remove_capability_key(segment_id)
        for slot in list(self._slots.values()):
            slot.transport.forget_segment(segment_id)

    def add_peer_segment(self, desc: SegmentDescriptor) -> None:
        """Learn a segment (own, same-host or remote). Idempotent; a changed
        descriptor for the same id drops cached transport state."""
        with self._lock:
            old = self._peers.get(desc.segment_id)
            self._peers[desc.segment_id] = desc
        if old is not None and old != desc:
            for slot in list(self._slots.values()):
                slot.transport.forget_segment(desc.segment_id)
        if old != desc:
            self._warm_gpu(desc, self._local.get(desc.segment_id))

    def remove_peer_segment(self, segment_id: str) -> None:
        """Forget a segment and drop cached mappings/connections for it."""
        with self._lock:
            self._peers.pop(segment_id, None)
        for slot in list(self._slots.values()):
            slot.transport.forget_segment(segment_id)

    def register_buffer(self, obj: Any, length: int | None = None,
                        device: str | None = None) -> BufferHandle:
        """Wrap ``obj`` once so later requests skip the conversion. The first GPU
        buffer makes the transports get ready for GPU requests to every segment
        known now or learned later, in the background (:meth:`wait_gpu_ready`)."""
        h = as_buffer(obj, length, device)
        h.registered = True
        if h.is_gpu and not self._gpu_in_use:
            with self._lock:
                first, self._gpu_in_use = not self._gpu_in_use, True
                known = [(d, self._local.get(d.segment_id)) for d in self._peers.values()]
                known += [(seg.descriptor(self.client_id, self._host_id, self.endpoint), seg)
                          for sid, seg in self._local.items() if sid not in self._peers]
            if first:
                for desc, local in known:
                    self._warm_gpu(desc, local)
        return h

    def _warm_gpu(self, desc: SegmentDescriptor, local: LocalSegment | None) -> None:
        """Let every transport prepare ``desc`` for GPU requests, in the background."""
        if not self._gpu_in_use or self._closed:
            return
        same_host = desc.host_id == self._host_id
        slots = list(self._slots.values())

        def warm() -> None:
            for slot in slots:
                try:
                    slot.transport.warm_gpu(desc, local, same_host)
                except Exception as exc:  # only slower: the first request does it
                    log.debug("%s: GPU warm-up of %s failed: %s", slot.transport.name,
                              desc.segment_id, exc)

        with self._lock:
            if self._warm_pool is None:
                self._warm_pool = ThreadPoolExecutor(1, thread_name_prefix="kvpool-gpu-warm")
            try:
                self._warm_futures.append(self._warm_pool.submit(warm))
            except RuntimeError:  # closing
                return
            self._warm_futures = [f for f in self._warm_futures if not f.done()]

    def wait_gpu_ready(self, timeout: float | None = None) -> bool:
        """Wait until the GPU preparations started so far are finished (True)."""
        with self._lock:
            pending = list(self._warm_futures)
        return not wait(pending, timeout).not_done

    def unregister_buffer(self, handle: BufferHandle) -> None:
        """Release transport state kept for the buffer and its reference."""
        handle.registered = False
        handle.close()

    # -- selection --------------------------------------------------------------
    def _rule_for(self, kind: SegmentKind, same_host: bool, device: str,
                  size: int) -> RuleConfig | None:
        key = (kind, same_host, device, size)
        try:
            return self._rule_cache[key]
        except KeyError:
            pass
        found = None
        for rule in self.config.rules:
            if rule.matches(kind, same_host, device, size):
                found = rule
                break
        if len(self._rule_cache) >= _RULE_CACHE:
            self._rule_cache.clear()
        self._rule_cache[key] = found
        return found

    def _next_transport(self, item: WorkItem, track: _Track) -> tuple[str | None, str]:
        """First candidate not yet tried that is loaded, supports the item and is
        not paused: (name, "") or (None, why none)."""
        why: list[str] = []
        for name in track.candidates:
            if name in track.tried:
                continue
            slot = self._slots.get(name)
            if slot is None:
                why.append(f"{name}: {self._unavailable.get(name, 'not loaded')}")
                continue
            if not slot.transport.supports(item.segment.kind, item.same_host, item.device):
                detail = ""
                if item.device == "cuda":
                    from kvpool.transfer.gpu import cuda_runtime

                    detail = f" ({cuda_runtime()[1]})" if cuda_runtime()[0] is None else ""
                why.append(f"{name}: does not support this request{detail}")
                continue
            if slot.paused(_peer_key(item)):
                why.append(f"{name}: paused after repeated failures towards this peer")
                continue
            return name, ""
        return None, "; ".join(why) or "no transport left"

    def _segment(self, segment_id: str) -> tuple[SegmentDescriptor, LocalSegment | None]:
        """The descriptor a request for ``segment_id`` goes by, and the segment
        object when this process owns it; SEGMENT_NOT_FOUND if unknown."""
        local = self._local.get(segment_id)
        desc = self._peers.get(segment_id)
        if local is not None:
            if desc is None or desc.client_id != self.client_id or desc.host_id != self._host_id:
                desc = local.descriptor(self.client_id, self._host_id, self.endpoint)
        elif desc is None:
            raise TransferError(f"unknown segment {segment_id!r} (add_peer_segment first)",
                                ErrorCode.SEGMENT_NOT_FOUND, retryable=False)
        return desc, local

    def _resolve(self, i: int, req: TransferRequest,
                 segs: dict[str, tuple[SegmentDescriptor, LocalSegment | None]] | None = None
                 ) -> tuple[WorkItem, list[str]]:
        """One request as a work item, and its candidate transports. ``segs``
        memoizes :meth:`_segment` within one submit (a batch names few segments)."""
        if type(req) is not TransferRequest and not isinstance(req, TransferRequest):
            raise TransferError(f"request {i} is not a TransferRequest", ErrorCode.INVALID_PARAMS,
                                retryable=False)
        op = req.op if type(req.op) is TransferOp else TransferOp(req.op)
        buf = req.buffer if type(req.buffer) is BufferHandle else as_buffer(req.buffer)
        sid = req.segment_id
        if segs is None:
            desc, local = self._segment(sid)
        else:
            found = segs.get(sid)
            if found is None:
                found = segs[sid] = self._segment(sid)
            desc, local = found
        offset, length, boff = req.offset, req.length, req.buffer_offset
        if not (type(offset) is int and type(length) is int and type(boff) is int) \
                and not all(isinstance(x, int) for x in (offset, length, boff)):
            raise TransferError("offset/length must be integers", ErrorCode.INVALID_PARAMS,
                                retryable=False)
        if offset < 0 or length < 0 or offset + length > desc.size:
            raise TransferError(
                f"range [{offset}, {offset + length}) outside segment "
                f"{sid!r} of {desc.size} bytes", ErrorCode.OUT_OF_BOUNDS,
                retryable=False)
        if boff < 0 or boff + length > buf.length:  # BufferHandle.check_range, inline
            buf.check_range(boff, length)
        if op is TransferOp.READ and buf.readonly:
            raise TransferError("READ into a read-only buffer", ErrorCode.INVALID_PARAMS,
                                retryable=False)
        same_host = desc.host_id == self._host_id
        cap = req.capability
        item = WorkItem(i, op, buf, boff, length, desc, offset, same_host,
                        local, cap if type(cap) is bytes else bytes(cap or b""))
        if req.transport:
            if req.transport not in self._slots and req.transport not in self._unavailable \
                    and load_transport_class(req.transport)[0] is None:
                raise TransferError(f"unknown transport {req.transport!r}",
                                    ErrorCode.INVALID_PARAMS, retryable=False)
            return item, [req.transport]
        rule = self._rule_for(desc.kind, same_host, buf.device, length)
        if rule is None:
            raise TransferError("no selector rule matches this request",
                                ErrorCode.TRANSPORT_UNAVAILABLE, retryable=False)
        return item, rule.transports

    # -- submit -----------------------------------------------------------------
    def submit(self, requests: Sequence[TransferRequest]) -> BatchHandle:
        """Start a batch; returns at once (sub-batches of at most the transport's
        ``inline_max_bytes`` are copied before returning). Invalid requests fail
        immediately (their status says why); the others run in per-transport
        sub-batches."""
        return self._submit(requests, sync=False, caller_deadline=None)

    def _submit(self, requests: Sequence[TransferRequest], sync: bool,
                caller_deadline: float | None) -> BatchHandle:
        if self._closed:
            raise TransferError("engine is closed", ErrorCode.CLOSED, retryable=False)
        handle = BatchHandle(len(requests))
        groups: dict[str, list[WorkItem]] = {}
        memo: dict[tuple[Any, ...], tuple[str | None, str]] = {}
        independent = copies_independent()
        segs: dict[str, tuple[SegmentDescriptor, LocalSegment | None]] = {}
        tracks = handle._tracks
        # (segment id, device, length) -> what the first such request resolved
        # to: later ones alike skip _resolve and _plan (the same checks, inline)
        alike: dict[tuple[str, str, int], tuple[SegmentDescriptor, LocalSegment | None, bool,
                                                Sequence[str], str, list[WorkItem]]] = {}
        read = TransferOp.READ
        for i, req in enumerate(requests):
            buf = req.buffer
            if type(req) is TransferRequest and type(buf) is BufferHandle and not req.transport:
                length = req.length
                known = alike.get((req.segment_id, buf.device, length))
                if known is not None:
                    desc, local, same_host, candidates, name, group = known
                    op, offset, boff = req.op, req.offset, req.buffer_offset
                    if type(offset) is int and type(boff) is int and type(op) is TransferOp \
                            and 0 <= offset and offset + length <= desc.size \
                            and 0 <= boff and boff + length <= buf.length \
                            and (op is not read or not buf.readonly):
                        cap = req.capability
                        group.append(WorkItem(i, op, buf, boff, length, desc, offset, same_host,
                                              local, cap if type(cap) is bytes
                                              else bytes(cap or b""), independent))
                        track = tracks[i]
                        track.candidates = candidates
                        track.tried.append(name)
                        continue
            try:
                item, candidates = self._resolve(i, req, segs)
                item.independent = independent
            except TransferError as exc:
                handle._finish(i, RequestState.FAILED, None, exc.code, str(exc))
                continue
            except Exception as exc:  # bad buffer object etc.
                handle._finish(i, RequestState.FAILED, None, ErrorCode.INVALID_PARAMS,
                               f"{type(exc).__name__}: {exc}")
                continue
            if item.length == 0:
                handle._finish(i, RequestState.DONE, None)
                continue
            track = tracks[i]
            track.candidates = candidates
            found = memo.get((id(candidates), id(item.segment), item.buffer.device))
            if found is not None and found[0] is not None:  # _plan's answer, already known
                name = found[0]
                track.tried.append(name)
                group = groups.setdefault(name, [])
                group.append(item)
            else:
                self._plan(handle, item, track, groups, memo=memo)
                if not track.tried:
                    continue  # failed: no usable transport
                name = track.tried[0]
                group = groups[name]
            if item.length > 0 and type(item.buffer) is BufferHandle and not req.transport:
                alike[(item.segment.segment_id, item.buffer.device, item.length)] = (
                    item.segment, item.local, item.same_host, candidates, name, group)
        self._launch(handle, groups, sync=sync, caller_deadline=caller_deadline)
        return handle

    def _first_choice(self, req: TransferRequest) -> tuple[WorkItem, Any, str] | None:
        """Request 0 of an inline attempt as a work item, its candidate
        transports and its first choice; None where the general path must
        take it (a pinned, invalid or empty request, no usable transport: it
        reports those with their codes). Raises CLOSED on a closed engine."""
        if self._closed:
            raise TransferError("engine is closed", ErrorCode.CLOSED, retryable=False)
        if type(req) is not TransferRequest or req.transport:
            return None
        try:
            item, candidates = self._resolve(0, req)
        except Exception:  # the general path fails it with the same code and message
            return None
        if item.length == 0:
            return None
        # _next_transport for a request nothing was tried for, without the
        # reasons (the general path gives them when no transport is left)
        slots = self._slots
        kind, same_host, device = item.segment.kind, item.same_host, item.buffer.device
        for name in candidates:
            slot = slots.get(name)
            if slot is not None and slot.transport.supports(kind, same_host, device) \
                    and not (slot.health and slot.paused(_peer_key(item))):
                return item, candidates, name
        return None

    def _run_one(self, requests: Sequence[TransferRequest], caller_deadline: float | None
                 ) -> RequestStatus | BatchHandle | None:
        """A lone request's first attempt, on the calling thread, without the
        batch bookkeeping (the general path runs it inline too, see
        :meth:`_launch`; this one skips the handle, sub-batch and report
        machinery while the attempt succeeds). Returns its DONE status; after a
        failed attempt, a handle that the general path has taken over from
        there (the same retries, failover and health accounting as if it had
        made the attempt); None where it does not apply (an invalid or pinned
        request, no usable transport: the general path reports those)."""
        first = self._first_choice(requests[0])
        if first is None:
            return None
        item, candidates, name = first
        item.independent = copies_independent()
        got = self._attempt_inline([item], candidates, name, self._slots[name], caller_deadline)
        return got[0] if isinstance(got, list) else got

    def _run_batch(self, requests: Sequence[TransferRequest], caller_deadline: float | None
                   ) -> list[RequestStatus] | BatchHandle | None:
        """A batch of requests alike (one segment, buffers of one device, one
        length: the pages of a KV batch) that the general path would run as
        one slice of one transport on the calling thread: its first attempt
        runs so, without the per-request tracks, statuses and sub-batch while
        it succeeds. Returns the DONE statuses; after an attempt in which
        anything failed, a handle that the general path has taken over from
        there (the same retries, failover, health accounting and error lists
        as if it had made the attempt); None where it does not apply (the
        general path then runs the batch from the start)."""
        first = requests[0]
        if type(first) is not TransferRequest or type(first.buffer) is not BufferHandle:
            return None
        buf0 = first.buffer
        chosen = self._first_choice(first)
        if chosen is None:
            return None
        item0, candidates, name = chosen
        length = item0.length
        slot = self._slots[name]
        n = len(requests)
        if slot.settings.threads > 1 and n * length >= 2 * _MIN_SLICE_BYTES:
            return None  # _launch would cut it into slices for the transport's threads
        desc, local, same_host = item0.segment, item0.local, item0.same_host
        sid, device, size = first.segment_id, buf0.device, desc.size
        independent = copies_independent()
        item0.independent = independent
        items = [item0]
        read = TransferOp.READ
        # the checks of _submit's path for requests alike, inline
        for i in range(1, n):
            req = requests[i]
            buf = req.buffer
            if type(req) is not TransferRequest or type(buf) is not BufferHandle \
                    or req.transport or req.segment_id != sid or buf.device != device \
                    or req.length != length:
                return None
            op, offset, boff = req.op, req.offset, req.buffer_offset
            if not (type(offset) is int and type(boff) is int and type(op) is TransferOp
                    and 0 <= offset and offset + length <= size
                    and 0 <= boff and boff + length <= buf.length
                    and (op is not read or not buf.readonly)):
                return None
            cap = req.capability
            items.append(WorkItem(i, op, buf, boff, length, desc, offset, same_host, local,
                                  cap if type(cap) is bytes else bytes(cap or b""), independent))
        return self._attempt_inline(items, candidates, name, slot, caller_deadline)

    def _attempt_inline(self, items: list[WorkItem], candidates: Any, name: str, slot: Any,
                        caller_deadline: float | None) -> list[RequestStatus] | BatchHandle:
        """One attempt of ``items`` (indices 0..n-1, all for transport ``name``)
        on the calling thread, without per-request tracks while it succeeds.
        Returns their DONE statuses; after an attempt in which anything failed,
        a handle that the general path has taken over from there, as if it had
        made the attempt (the same retries, failover, health accounting and
        error lists)."""
        n = len(items)
        deadline = time.monotonic() + slot.settings.timeout_s
        if caller_deadline is not None:
            deadline = min(deadline, caller_deadline)
        got: list[Any] = [_UNREPORTED] * n  # None: done; an error: failed (first report)
        failures: list[tuple[WorkItem, TransferError]] = []  # in the order reported

        def report(it: WorkItem, err: TransferError | None) -> None:
            if got[it.index] is _UNREPORTED:
                got[it.index] = err
                if err is not None:
                    failures.append((it, err))

        def report_many(its: Sequence[WorkItem]) -> None:  # successes
            for it in its:
                if got[it.index] is _UNREPORTED:
                    got[it.index] = None

        report.many = report_many  # type: ignore[attr-defined]  # see base.report_done
        crash: TransferError | None = None
        started = time.monotonic()
        try:
            slot.transport.execute(items, deadline, report)
        except TransferError as exc:
            crash = exc
        except Exception as exc:
            log.exception("transport %s crashed on an inline attempt", name)
            crash = TransferError(f"{type(exc).__name__}: {exc}", ErrorCode.TRANSFER_FAIL)
        if crash is None and got.count(None) == n:
            if slot.health:  # a success towards a peer clears its failure count
                self._update_health(slot, SubBatch(next(self._sb_ids), name, items), [])
            return [RequestStatus(_DONE, name, _OK, []) for _ in range(n)]
        # something failed: the general path takes the attempt over, as if it had made it
        handle = BatchHandle(n)
        sb = SubBatch(next(self._sb_ids), name, items, SubBatchState.RUNNING, started=started)
        sb._slices_left = 1
        handle.sub_batches.append(sb)
        tracks = handle._tracks
        reported = sb._reported
        with handle._lock:
            for it in items:
                i = it.index
                t = tracks[i]
                t.candidates = candidates
                t.tried.append(name)
                st = t.status
                st.state = _RUNNING
                st.transport = name
                if got[i] is None:
                    reported.add(i)
                    sb.done += 1
                    handle._finish_locked(i, _DONE, name)
            for it, err in failures:
                reported.add(it.index)
                sb.failed += 1
                sb._failures.append((it, err))
        self._slice_done(handle, sb, slot, items, crash)
        return handle

    def _plan(self, handle: BatchHandle, item: WorkItem, track: _Track,
              groups: dict[str, list[WorkItem]], last_error: TransferError | None = None,
              memo: dict[tuple[Any, ...], tuple[str | None, str]] | None = None) -> None:
        """Put ``item`` into the group of its next transport, or fail it. ``memo``
        remembers first choices within one submit (requests alike in candidates,
        segment kind, host, device and peer get the same answer)."""
        if memo is not None and not track.tried:
            # kind, host and peer all follow from the descriptor object, which
            # the items of one submit share per segment (and keep alive); the
            # same key is looked up in _submit
            key = (id(track.candidates), id(item.segment), item.buffer.device)
            found = memo.get(key)
            if found is None:
                found = memo[key] = self._next_transport(item, track)
            name, why = found
        else:
            name, why = self._next_transport(item, track)
        if name is None:
            code = last_error.code if last_error is not None else ErrorCode.TRANSPORT_UNAVAILABLE
            last = track.tried[-1] if track.tried else None
            handle._finish(item.index, RequestState.FAILED, last, code,
                           None if last_error is not None else f"no usable transport: {why}")
            return
        track.tried.append(name)
        groups.setdefault(name, []).append(item)

    def _launch(self, handle: BatchHandle, groups: dict[str, list[WorkItem]],
                sync: bool = False, caller_deadline: float | None = None) -> None:
        for name, items in groups.items():
            slot = self._slots[name]
            sb = SubBatch(id=next(self._sb_ids), transport=name, items=items)
            tracks = handle._tracks
            total = 0
            with handle._lock:
                handle.sub_batches.append(sb)
                for it in items:
                    st = tracks[it.index].status
                    st.state = _RUNNING
                    st.transport = name
                    total += it.length
            # a second slice costs a thread hop: only a large sub-batch gains from it
            n = max(1, min(slot.settings.threads, len(items), total // _MIN_SLICE_BYTES))
            step = (len(items) + n - 1) // n
            slices = [items[k:k + step] for k in range(0, len(items), step)]
            sb._slices_left = len(slices)
            # no thread hop for one slice (the caller waits anyway, or the copy is tiny)
            inline = (sync and len(groups) == 1) or (
                len(slices) == 1 and total <= int(slot.settings.inline_max_bytes))
            for part in slices[:-1] if inline else slices:
                try:
                    slot.pool.submit(self._run_slice, handle, sb, slot, part, None)
                except RuntimeError as exc:  # pool shut down (engine closing)
                    self._slice_done(handle, sb, slot, part,
                                     TransferError(str(exc), ErrorCode.CLOSED, retryable=False))
            if inline:
                self._run_slice(handle, sb, slot, slices[-1], caller_deadline)

    def _run_slice(self, handle: BatchHandle, sb: SubBatch, slot: _TransportSlot,
                   part: list[WorkItem], caller_deadline: float | None) -> None:
        with handle._lock:
            if sb.state is SubBatchState.PENDING:
                sb.state = SubBatchState.RUNNING
                sb.started = time.monotonic()
        deadline = time.monotonic() + slot.settings.timeout_s
        if caller_deadline is not None:
            deadline = min(deadline, caller_deadline)

        lock, reported, finish, name = handle._lock, sb._reported, handle._finish_locked, \
            sb.transport

        def report(item: WorkItem, err: TransferError | None) -> None:  # once per item
            idx = item.index
            with lock:
                if idx in reported:
                    return
                reported.add(idx)
                if err is None:
                    sb.done += 1
                    finish(idx, _DONE, name)
                else:
                    sb.failed += 1
                    sb._failures.append((item, err))

        def report_many(items: Sequence[WorkItem]) -> None:  # successes, one lock for all
            with lock:
                for item in items:
                    idx = item.index
                    if idx in reported:
                        continue
                    reported.add(idx)
                    sb.done += 1
                    finish(idx, _DONE, name)

        report.many = report_many  # type: ignore[attr-defined]  # see base.report_done
        crash: TransferError | None = None
        try:
            slot.transport.execute(part, deadline, report)
        except TransferError as exc:
            crash = exc
        except Exception as exc:
            log.exception("transport %s crashed on a sub-batch", sb.transport)
            crash = TransferError(f"{type(exc).__name__}: {exc}", ErrorCode.TRANSFER_FAIL)
        self._slice_done(handle, sb, slot, part, crash)

    def _slice_done(self, handle: BatchHandle, sb: SubBatch, slot: _TransportSlot,
                    part: list[WorkItem], crash: TransferError | None) -> None:
        with handle._lock:
            for it in part:  # items the transport never reported
                if it.index not in sb._reported:
                    sb._reported.add(it.index)
                    sb.failed += 1
                    sb._failures.append((it, crash or TransferError(
                        "transport returned without reporting the request",
                        ErrorCode.TRANSFER_FAIL)))
            sb._slices_left -= 1
            if sb._slices_left > 0:
                return
            sb.finished = time.monotonic()
            failures = list(sb._failures)
            sb.state = SubBatchState.FAILED if failures else SubBatchState.DONE
            if failures:
                sb.error = str(failures[0][1])
        self._update_health(slot, sb, failures)
        groups: dict[str, list[WorkItem]] = {}
        for item, err in failures:
            track = handle._tracks[item.index]
            msg = f"{sb.transport}: {err}"
            with handle._lock:
                track.status.errors.append(msg)
                track.status.code = err.code
                if track.attempts is None:
                    track.attempts = {}
                track.attempts[sb.transport] = track.attempts.get(sb.transport, 0) + 1
            if not err.retryable or self._closed:
                handle._finish(item.index, RequestState.FAILED, sb.transport, err.code)
                continue
            assert track.attempts is not None
            if track.attempts[sb.transport] <= slot.settings.retries \
                    and not slot.paused(_peer_key(item)):
                groups.setdefault(sb.transport, []).append(item)
                continue
            if track.failovers >= self.config.max_failover:
                handle._finish(item.index, RequestState.FAILED, sb.transport, err.code)
                continue
            before = len(track.tried)
            self._plan(handle, item, track, groups, last_error=err)
            if len(track.tried) > before:
                track.failovers += 1
                log.info("request %d failed on %s (%s); failing over to %s", item.index,
                         sb.transport, err, track.tried[-1])
        if groups:
            self._launch(handle, groups)

    def _update_health(self, slot: _TransportSlot, sb: SubBatch,
                       failures: list[tuple[WorkItem, TransferError]]) -> None:
        # per peer, an attempt counts against the transport only if nothing got
        # through to that peer and a failure was the transport's (not a
        # bounds/permission refusal, which is final and says nothing of health)
        if not failures and not slot.health:
            return
        failed_peers = {_peer_key(it) for it, e in failures if e.retryable}
        failed_items = {it.index for it, _ in failures}
        ok_peers = {_peer_key(it) for it in sb.items if it.index not in failed_items}
        with self._lock:
            for peer in ok_peers:
                h = slot.health.get(peer)
                if h is not None:
                    h[0] = 0
            for peer in failed_peers - ok_peers:
                h = slot.health.setdefault(peer, [0, 0.0])
                h[0] += 1
                if h[0] >= slot.settings.pause_after_failures:
                    h[0] = 0
                    h[1] = time.monotonic() + slot.settings.cooldown_s
                    log.warning("transport %s paused for %.1fs towards %s after repeated "
                                "failures", sb.transport, slot.settings.cooldown_s, peer)

    def copy_gpu_shm(self, jobs: Sequence[tuple[BufferHandle, str, int, int]], write: bool) -> bool:
        """Copy ``(GPU buffer, segment id, segment offset, bytes)`` jobs (from byte
        0 of each buffer) through the ``shm`` transport directly, without work
        items or sub-batches: one stream, one wait (see ``ShmTransport.copy_gpu``).
        Returns False, having copied nothing, unless every job is a GPU
        :class:`BufferHandle` and a same-host memory segment that the selector
        sends GPU buffers of that size to ``shm`` first (the caller then submits
        the jobs as a batch). Raises TransferError when a copy failed."""
        slot = self._slots.get("shm")
        copy = getattr(slot.transport, "copy_gpu", None) if slot is not None else None
        if copy is None or self._closed:
            return False
        segs: dict[str, tuple[SegmentDescriptor, LocalSegment | None]] = {}
        by_device: dict[int, list[tuple[SegmentDescriptor, LocalSegment | None, int, int,
                                        int]]] = {}
        memory = SegmentKind.MEMORY
        for buf, sid, off, n in jobs:
            if type(buf) is not BufferHandle or buf.device != "cuda" or n > buf.length \
                    or (not write and buf.readonly):
                return False
            found = segs.get(sid)
            if found is None:
                try:
                    found = segs[sid] = self._segment(sid)
                except TransferError:
                    return False
                if found[0].kind != memory or found[0].host_id != self._host_id:
                    return False
            rule = self._rule_for(memory, True, "cuda", n)
            if rule is None or not rule.transports or rule.transports[0] != "shm":
                return False
            desc, local = found
            by_device.setdefault(buf.device_index, []).append((desc, local, off, buf.ptr, n))
        independent = copies_independent()
        for device, items in by_device.items():
            copy(items, write, device, independent)
        return True

    def _start_sync(self, requests: Sequence[TransferRequest],
                    deadline: float | None) -> list[RequestStatus] | BatchHandle:
        """Start a batch the caller waits for: a lone request's, or an alike
        batch's, first attempt inline (the statuses when it succeeded), else
        the batch's handle (which has taken over a failed inline attempt)."""
        one: RequestStatus | list[RequestStatus] | BatchHandle | None
        if len(requests) == 1:
            one = self._run_one(requests, deadline)
        else:
            one = self._run_batch(requests, deadline) if requests else None
        if isinstance(one, RequestStatus):
            return [one]
        if one is not None:
            return one
        return self._submit(requests, sync=True, caller_deadline=deadline)

    def run(self, requests: Sequence[TransferRequest], timeout: float) -> list[RequestStatus]:
        """Run a batch, in the calling thread where one transport serves it, and
        wait at most ``timeout`` seconds. Never raises for a slow batch: a
        request still unfinished then is reported FAILED with TIMEOUT (a reader
        moves on to another replica instead of waiting on a dead peer)."""
        deadline = time.monotonic() + timeout
        handle = self._start_sync(requests, deadline)
        if type(handle) is list:
            return handle
        assert isinstance(handle, BatchHandle)
        handle.wait(max(0.0, deadline - time.monotonic()))
        out = []
        with handle._lock:
            for t in handle._tracks:
                st = t.status
                if st.state is not _DONE and st.state is not _FAILED:
                    st = RequestStatus(RequestState.FAILED, st.transport, ErrorCode.TIMEOUT,
                                       [*st.errors, f"no answer within {timeout:.2f}s"])
                out.append(st)  # a terminal status is never changed again: no copy
        return out

    def transfer(self, requests: Sequence[TransferRequest],
                 timeout: float | None = None) -> list[RequestStatus]:
        """submit + wait. Raises ``TransferError(TIMEOUT)`` if not all requests
        are terminal within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = self._start_sync(requests, deadline)
        if type(handle) is list:
            return handle
        assert isinstance(handle, BatchHandle)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        finished = handle.wait(left)
        if deadline is not None and time.monotonic() >= deadline and not handle.ok:
            finished = False  # an inline attempt was cut short by the caller's deadline
        if not finished:
            raise TransferError(f"batch of {len(requests)} not finished within {timeout}s",
                                ErrorCode.TIMEOUT)
        with handle._lock:  # all terminal, never changed again: no copies
            return [t.status for t in handle._tracks]

    def close(self) -> None:
        """Stop the server, the worker pools and every transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._warm_pool is not None:
            self._warm_pool.shutdown(wait=True, cancel_futures=True)
        self.segment_server.close()
        for slot in list(self._slots.values()):
            slot.pool.shutdown(wait=False)
            slot.transport.close()
        self._slots.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

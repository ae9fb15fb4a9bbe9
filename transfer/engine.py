"""TransferEngine: the transfer engine's front door.

One engine per process moves bytes between caller buffers and segments
(owned, same-host or remote). It holds

- the segment registry (:mod:`kvpool.transfer.registry`): every segment the
  process can address, and one mapping per same-host shm file;
- this process's transfer server (:mod:`kvpool.transfer.server`), which
  serves the owned segments to peers, behind capability checks;
- the transports and the selector over them (:mod:`kvpool.transfer.selection`);
- the batch runner (:mod:`kvpool.transfer.runner`): one path for every
  batch, from a lone request run on the caller's thread to a large batch
  split into per-transport sub-batches with retries and failover
  (:mod:`kvpool.transfer.batch`).

The engine never knows about keys. See docs/INTERFACES.md, "Transfer engine".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvpool.core.auth import CurveConfig
from kvpool.core.capability import CapabilityVerifier as CapVerifier
from kvpool.core.capability import CapOp
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.batch import BatchHandle, SubBatch, SubBatchState
from kvpool.transfer.buffers import BufferHandle, as_buffer
from kvpool.transfer.config import TransferConfig, TransportSettings
from kvpool.transfer.registry import SegmentRegistry
from kvpool.transfer.runner import BatchRunner
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.selection import Transports
from kvpool.transfer.server import TransferServer
from kvpool.transfer.transports.base import Transport
from kvpool.transfer.types import RequestStatus, TransferOp, TransferRequest

__all__ = ["BatchHandle", "SubBatch", "SubBatchState", "TransferEngine"]

log = logging.getLogger(__name__)
_CAP_OPS = {TransferOp.READ: CapOp.READ, TransferOp.WRITE: CapOp.WRITE}


class TransferEngine:
    """Moves bytes between caller buffers and segments (module docstring).

    Starts this process's transfer server (unless ``config.server.enabled`` is
    false) and loads every enabled transport.
    """

    def __init__(self, config: TransferConfig, host_id: str, bind_host: str = "127.0.0.1",
                 port: int = 0, client_id: str = "", curve: CurveConfig | None = None) -> None:
        self.config = config
        #: CURVE policy for the server socket and the tcp transport's client sockets
        self.curve = curve
        # capability keys of local segments (docs/security.md); refusals counted by reason
        scfg = config.server
        self.capabilities = CapVerifier(required=scfg.capabilities == "on",
                                        leeway_ms=scfg.capability_leeway_ms)
        self.client_id = client_id
        self._lock = threading.RLock()
        #: every segment this process can address (shared with the store client)
        self.registry = SegmentRegistry(host_id, client_id)
        self._transports = Transports(config)
        self._runner = BatchRunner(config, self.registry, self._transports)
        self._gpu_in_use = False  # a GPU buffer was registered: prepare segments for it
        self._warm_pool: ThreadPoolExecutor | None = None
        self._warm_futures: list[Future[None]] = []
        self._closed = False
        self._server: TransferServer | None = None
        if config.server.enabled:
            self._server = TransferServer(self.local_segment, bind_host, port, config.server,
                                          curve=curve, tcp_congestion=config.tcp_congestion)
            self._server.stats_hook = self.capability_stats
            if scfg.capabilities == "on":
                self._server.set_capability_check(self._verify_capability,
                                                   self._verify_capability_many)
            self.registry.endpoint = self._server.endpoint
        self.registry.on_forget.append(self._transports.forget_segment)
        self.registry.on_learn.append(self._warm_gpu)
        try:
            self._transports.load(self)
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise

    # -- EngineContext ----------------------------------------------------------
    @property
    def host_id(self) -> str:
        return self.registry.host_id

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` of this process's transfer server ("" if disabled)."""
        return self._server.endpoint if self._server is not None else ""

    @property
    def server(self) -> TransferServer | None:
        """The transfer server (capability checking sets ``server.verify_capability``)."""
        return self._server

    @property
    def tcp_congestion(self) -> str:
        """The congestion-control policy of this process's bulk sockets."""
        return self.config.tcp_congestion

    def local_segment(self, segment_id: str) -> LocalSegment | None:
        return self.registry.local(segment_id)

    # -- capabilities (docs/security.md) ------------------------------------------------
    def set_capability_key(self, segment_id: str, key: bytes) -> None:
        """Install the key the master handed over at (re-)mount for a local
        segment. From then on (unless ``server.capabilities: off``) the
        transfer server refuses every READ/WRITE of it without a capability
        signed with this key (PERMISSION_DENIED)."""
        if self.config.server.capabilities == "off":
            return
        self.capabilities.set_key(segment_id, key)
        if self._server is not None:
            self._server.set_capability_check(self._verify_capability,
                                               self._verify_capability_many)

    def remove_capability_key(self, segment_id: str) -> None:
        self.capabilities.remove_key(segment_id)

    def observe_master_epoch(self, epoch: int) -> None:
        """The master's leader epoch (from its PING reply): capabilities signed
        in an older term are refused from now on (STALE_EPOCH, docs/ha.md)."""
        if self.capabilities.observe_epoch(epoch):
            log.info("capability epoch raised to %d by the master", epoch)

    def _verify_capability(self, seg: LocalSegment, op: TransferOp, off: int, n: int,
                           cap: bytes) -> ErrorCode | None:
        """The server hook: raises CapabilityError (PERMISSION_DENIED + reason)."""
        v = self.capabilities
        if not v.required and not v.has_key(seg.segment_id):
            return None  # auto mode: the master gave this segment no key
        # a CapOp spares the verifier's by-name coercion of each range's op
        v.check(cap, seg.segment_id, off, n, _CAP_OPS.get(op, op), required=True)
        return None

    def _verify_capability_many(self, seg: LocalSegment, op: TransferOp, offsets: list[int],
                                lengths: list[int], cap: bytes) -> bool:
        """The server's batch hook: True when ``cap`` allows every range (one
        token lookup for all of them); False sends the caller to the per-range
        hook, which refuses with the reason."""
        v = self.capabilities
        if not v.required and not v.has_key(seg.segment_id):
            return True  # auto mode: the master gave this segment no key
        want = _CAP_OPS.get(op)
        return want is not None and v.check_many(cap, seg.segment_id, offsets, lengths, want)

    def capability_stats(self) -> dict[str, Any]:
        """``capability_refusals`` by reason and ``capability_accepted``."""
        v = self.capabilities
        return {"capability_refusals": {r.value: n for r, n in v.refusals.items()},
                "capability_accepted": v.accepted, "capability_epoch": v.epoch}

    # -- transports -------------------------------------------------------------
    def register_transport(self, transport: Transport,
                           settings: TransportSettings | None = None) -> None:
        """Add (or replace) a transport instance under ``transport.name``; the
        selector uses it wherever a rule or hint names it."""
        self._transports.register(transport, settings, self)

    def transports(self) -> dict[str, tuple[bool, str]]:
        """name -> (usable, reason) for every transport the config mentions."""
        return self._transports.states()

    def transport(self, name: str) -> Transport | None:
        slot = self._transports.slots.get(name)
        return slot.transport if slot else None

    # -- segments and buffers ---------------------------------------------------
    def add_local_segment(self, segment: LocalSegment) -> SegmentDescriptor:
        """Serve ``segment`` (owned by this process) and make it addressable by id.
        Returns the descriptor to publish (the master hands it to peers): with
        :meth:`describe_extra`'s entries."""
        desc = segment.descriptor(self.client_id, self.host_id, self.endpoint)
        desc.extra.update(self.describe_extra(segment))
        self.registry.add_local(segment, desc)
        return desc

    def describe_extra(self, segment: LocalSegment) -> dict[str, Any]:
        """What this process adds to ``segment``'s descriptor ``extra`` for its
        peers: the transfer server's bulk offer for a memory segment (a peer's
        first tcp request then goes straight to the bulk socket, instead of
        over ZeroMQ while it asks for the port)."""
        if self._server is None or segment.kind != SegmentKind.MEMORY:
            return {}
        return self._server.bulk_extra()

    def remove_local_segment(self, segment_id: str) -> None:
        """Stop serving the segment (the caller still owns and closes it)."""
        self.registry.remove_local(segment_id)
        self.capabilities.remove_key(segment_id)
        self._transports.forget_segment(segment_id)

    def add_peer_segment(self, desc: SegmentDescriptor) -> None:
        """Learn a segment (own, same-host or remote). Idempotent; a changed
        descriptor for the same id drops cached transport state."""
        self.registry.learn({desc.segment_id: desc})

    def remove_peer_segment(self, segment_id: str) -> None:
        """Forget a segment and drop cached mappings/connections for it."""
        self.registry.forget(segment_id)

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
            if first:
                for desc, local in self.registry.known():
                    self._warm_gpu(desc, local)
        return h

    def _warm_gpu(self, desc: SegmentDescriptor, local: LocalSegment | None) -> None:
        """Let every transport prepare ``desc`` for GPU requests, in the background."""
        if not self._gpu_in_use or self._closed:
            return
        same_host = desc.host_id == self.host_id
        slots = list(self._transports.slots.values())

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

    # -- batches ----------------------------------------------------------------
    def submit(self, requests: Sequence[TransferRequest]) -> BatchHandle:
        """Start a batch; returns at once (sub-batches of at most the transport's
        ``inline_max_bytes`` are copied before returning). Invalid requests fail
        immediately (their status says why); the others run in per-transport
        sub-batches. The engine resolves each request in place (see
        :class:`TransferRequest`)."""
        return self._runner.submit(requests)

    def run(self, requests: Sequence[TransferRequest], timeout: float) -> list[RequestStatus]:
        """Run a batch, in the calling thread where one transport serves it in
        one slice, and wait at most ``timeout`` seconds. Never raises for a
        slow batch: a request still unfinished then is reported FAILED with
        TIMEOUT (a reader moves on to another replica instead of waiting on a
        dead peer)."""
        return self._runner.run(requests, timeout)

    def transfer(self, requests: Sequence[TransferRequest],
                 timeout: float | None = None) -> list[RequestStatus]:
        """submit + wait. Raises ``TransferError(TIMEOUT)`` if not all requests
        are terminal within ``timeout`` seconds."""
        return self._runner.transfer(requests, timeout)

    def close(self) -> None:
        """Stop the server, the worker pools and every transport. Idempotent."""
        if self._closed:
            return
        self._closed = self._runner.closed = True
        if self._warm_pool is not None:
            self._warm_pool.shutdown(wait=True, cancel_futures=True)
        if self._server is not None:
            self._server.close()
        self._transports.close()
        self.registry.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""TransferEngine: the transfer engine's front door.

One engine per process moves bytes between caller buffers and segments
(owned, same-host or remote). It holds

- the segment registry (:mod:`kvpool.transfer.registry`): every segment the
  process can address, and one mapping per same-host shm file;
- the segment server (:mod:`kvpool.transfer.segment_server`), which serves
  the owned segments to peers, behind capability checks;
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
from kvpool.core.capability import CapabilityVerifier
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.batch import BatchHandle, SubBatch, SubBatchState
from kvpool.transfer.buffers import BufferHandle, as_buffer
from kvpool.transfer.config import TransferConfig, TransportSettings
from kvpool.transfer.counters import TransferCounters
from kvpool.transfer.registry import SegmentRegistry
from kvpool.transfer.runner import BatchRunner
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.segment_server import SegmentServer
from kvpool.transfer.selection import Transports
from kvpool.transfer.transports.base import Transport
from kvpool.transfer.types import RequestStatus, TransferRequest

__all__ = ["BatchHandle", "SubBatch", "SubBatchState", "TransferEngine"]

log = logging.getLogger(__name__)


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
        self.client_id = client_id
        self._lock = threading.RLock()
        #: every segment this process can address (shared with the store client)
        self.registry = SegmentRegistry(host_id, client_id)
        #: transfers served by its server and made by its batches (node metrics)
        self.counters = TransferCounters()
        self._transports = Transports(config, self.counters)
        self._runner = BatchRunner(config, self.registry, self._transports)
        self._gpu_in_use = False  # a GPU buffer was registered: prepare segments for it
        self._warm_pool: ThreadPoolExecutor | None = None
        self._warm_futures: list[Future[None]] = []
        self._closed = False
        #: serves the local segments to peers and checks their capabilities
        self.segment_server = SegmentServer(self.local_segment, config.server, bind_host, port,
                                            curve=curve, tcp_congestion=config.tcp_congestion,
                                            counters=self.counters)
        self.registry.endpoint = self.segment_server.endpoint
        self.registry.on_forget.append(self._transports.forget_segment)
        self.registry.on_learn.append(self._warm_gpu)
        try:
            self._transports.load(self)
        except BaseException:
            self.segment_server.close()
            raise

    # -- EngineContext ----------------------------------------------------------
    @property
    def host_id(self) -> str:
        return self.registry.host_id

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
        return self.registry.local(segment_id)

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
        if segment.kind != SegmentKind.MEMORY:
            return {}
        return self.segment_server.bulk_extra()

    def remove_local_segment(self, segment_id: str) -> None:
        """Stop serving the segment (the caller still owns and closes it)."""
        self.registry.remove_local(segment_id)
        self.segment_server.remove_capability_key(segment_id)
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
        self.segment_server.close()
        self._transports.close()
        self.registry.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

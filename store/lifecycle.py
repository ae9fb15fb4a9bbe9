"""What one store client is made of: built at setup, released exactly once.

:class:`ClientParts` holds every part of a :class:`kvpool.store.Client` — the
master session, the transfer engine (with the segment registry the whole
client shares), the segment host (the memory and disk it contributes, its
guard), and the paths built on them: writes, reads, multi-buffer values,
pipelined reads, queries. ``setup()`` builds them (a typed error, everything
released, when any step fails); ``release()`` unmounts, stops serving, frees
the memory and closes the sockets, in that order, each step whatever the
previous one raised. The Client's finalizer holds the parts, never the
Client, so a Client dropped without ``close()`` is collected and released
(also at interpreter exit); a process that dies is released by its guard.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NoReturn

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import BatchExist, SegmentKind
from kvpool.core.rpc_client import MasterRPCError
from kvpool.store.admin import Admin
from kvpool.store.config import ClientConfig
from kvpool.store.errors import MasterUnreachable, StoreError, error_for_code
from kvpool.store.multibuffer import MultiBuffer
from kvpool.store.pipelined import Pipelined
from kvpool.store.reads import Reads
from kvpool.store.segment_host import SegmentHost
from kvpool.store.session import MasterSession
from kvpool.store.writes import Writes

__all__ = ["ClientParts"]

log = logging.getLogger(__name__)


class _NotSetUp:
    """Stands for a path before setup(): any use is a typed CLOSED error."""

    def __getattr__(self, name: str) -> NoReturn:
        raise StoreError("client is not set up; call setup()", ErrorCode.CLOSED)


_NOT_SET_UP: Any = _NotSetUp()


class ClientParts:
    """The parts of one client (module docstring)."""

    def __init__(self, config: ClientConfig, client_id: str, host_id: str) -> None:
        self.config = config
        self.client_id = client_id
        self.host_id = host_id
        self.session = MasterSession(config, client_id)
        self.host = SegmentHost(config, client_id, host_id, self.session.new_stub)
        self.admin = Admin(self.session)
        self.engine: Any = None
        self.writes: Writes = _NOT_SET_UP
        self.reads: Reads = _NOT_SET_UP
        self.multi: MultiBuffer = _NOT_SET_UP
        self.pipelined: Pipelined = _NOT_SET_UP
        self._gpu_warm = False  # see register_buffer
        self._released = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Connect, start the transfer server, create and mount the segments,
        start the pinger. Raises MasterUnreachable if the master does not
        answer within ``rpc_timeout_s``; any failure releases what was made."""
        if self.session.started or self.session.closed:
            if self.session.closed:
                raise StoreError("client is closed", ErrorCode.CLOSED)
            return
        try:
            self._setup()
        except StoreError:
            self.release()
            raise
        except KVPoolError as exc:  # e.g. a TransferError creating the segment: typed
            self.release()
            raise error_for_code(exc.code, f"setup failed: {exc}") from exc
        except BaseException:
            self.release()
            raise

    def _setup(self) -> None:
        import kvpool.transfer as transfer  # lazy: keeps `import kvpool.store` light

        cfg = self.config
        master = self.session.open()
        try:  # fail fast (typed) when the master is not there, before allocating memory
            self.host.check_master()
        except MasterRPCError as exc:
            raise MasterUnreachable(
                f"master {cfg.master_address} unreachable: {exc}", exc.code) from exc
        if self.session.tenant:  # one empty scoped call: a tenant this connection may
            # not act as (tenant_keys under CURVE) is refused now, not at the first put
            try:
                self.session.call(BatchExist([]))
            except StoreError as exc:
                raise error_for_code(exc.code, f"tenant {cfg.tenant!r}: {exc.args[0]}") from exc
        tcfg = transfer.load_transfer_config(cfg.transfer_config, cfg.transfer_overrides or None)
        self.engine = transfer.TransferEngine(
            tcfg, host_id=self.host_id, bind_host=cfg.bind_host, port=cfg.transfer_port,
            client_id=self.client_id, curve=cfg.curve)
        self.writes = Writes(self.session, self.engine, cfg)
        self.reads = Reads(self.session, self.engine, cfg)
        self.multi = MultiBuffer(self.writes, self.reads)
        self.pipelined = Pipelined(self.reads)
        port = self.engine.endpoint.rsplit(":", 1)[-1]
        self.host.create_segments(self.engine, cfg.segment_id or f"{self.host_id}:{port}")
        self.host.start(master)
        log.info("client %s up: host %s, segments %s, endpoint %s", self.client_id[:8],
                 self.host_id, self.host.segment_ids, self.engine.endpoint)

    def register_buffer(self, buffer: Any, device: str | None = None) -> Any:
        """Register host or GPU memory with the engine (see Client.register_buffer).
        The first GPU buffer learns every memory segment now (one LIST_SEGMENTS),
        so the engine page-locks their mappings in the background instead of
        inside the first put or get (tens of ms per segment)."""
        self.session.check()
        try:
            handle = self.engine.register_buffer(buffer, device=device) if device is not None \
                else self.engine.register_buffer(buffer)
        except KVPoolError as exc:
            raise error_for_code(exc.code, str(exc)) from exc
        if handle.is_gpu and not self._gpu_warm:
            self._gpu_warm = True
            try:
                segs = self.admin.list_segments()
            except StoreError as exc:
                log.debug("list_segments for GPU warm-up: %s", exc)
            else:
                self.engine.registry.learn({s.descriptor.segment_id: s.descriptor for s in segs
                                            if s.descriptor.kind == SegmentKind.MEMORY})
        return handle

    def unregister_buffer(self, handle: Any) -> None:
        self.session.check()
        try:
            self.engine.unregister_buffer(handle)
        except KVPoolError as exc:
            raise error_for_code(exc.code, str(exc)) from exc

    # ------------------------------------------------------------------ release

    def close(self) -> None:
        """Give the spare allocations back, then release everything. Idempotent."""
        if self.session.closed:
            return
        if self.writes is not _NOT_SET_UP:
            self.writes.spares.close()
        self.release()

    def release(self) -> None:
        """Unmount, stop serving, free the memory, close the sockets (in that
        order), each step whatever the previous one raised. Runs once."""
        with self._lock:
            if self._released:
                return
            self._released = True
        stubs = self.session.close()
        host = self.host
        if not host.owned_here():
            return  # a forked child's copy: the segments, guard and sockets are the parent's
        host.stop()
        host.unmount()
        host.detach()
        if self.multi is not _NOT_SET_UP:
            self.multi.close()
        host.release_segments()
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception as exc:
                log.warning("closing transfer engine: %s", exc)
        for stub in stubs:
            stub.close()
        host.close_stubs()
        host.close_guard()

"""The store client's session with the master.

A :class:`MasterSession` is how every part of a client talks to the master:

- one RPC stub per calling thread (a stub serialises its calls, so threads do
  not queue behind each other's round trips; past ``_MAX_STUBS`` threads
  share), each following the leader of an HA group by itself;
- the open/closed state every call checks (typed CLOSED errors);
- the master *term* (leader epoch) a call was answered in: a put whose
  grant came from one leader and whose commit reaches another is done again
  (``term_changed``, ``redoing``), and a commit answered
  WRITE_OUTCOME_UNKNOWN is sent once more (``send_commit``);
- locating keys for reads (one BATCH_GET_REPLICA_LIST, with the deadline of
  the read lease it granted), also from a helper thread (``locate_later``);
- the tenant (``ClientConfig.tenant``, docs/tenants.md): every request sent
  here that has a ``tenant`` field (each that names, lists, counts or removes
  objects) is stamped with it on its way out (:meth:`MasterSession.scoped`),
  so no part of the client builds a request for another tenant, or forgets
  to name its own. The default tenant leaves the field ``""``, what a
  client from before tenants means by sending nothing there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    OPS,
    TENANT_FIELD_DEFAULT,
    BatchGetReplicaList,
    BatchGetReplicaListReply,
    BatchPutEnd,
    BatchPutRevoke,
    GetReplicaList,
    PutEnd,
    PutRevoke,
    Reply,
    Request,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from kvpool.core.tenants import DEFAULT_TENANT
from kvpool.store.config import ClientConfig
from kvpool.store.errors import MasterUnreachable, StoreError, error_for_code
from kvpool.store.guard import master_stub

__all__ = ["MasterSession"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Reply)
_MAX_STUBS = 16  # per client; threads beyond share them
# what a master answers about one key rather than about the call
_KEY_CODES = frozenset({ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_KEY,
                        ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.OBJECT_HAS_LEASE})
#: the request types that act for a tenant (their last field is ``tenant``)
_SCOPED: frozenset[type] = frozenset(
    spec.request for spec in OPS.values() if "tenant" in spec.request.__struct_fields__)


class MasterSession:
    """RPC stubs, terms and locating for one client (module docstring)."""

    def __init__(self, config: ClientConfig, client_id: str) -> None:
        self.config = config
        self.client_id = client_id
        #: the ``tenant`` field of this client's requests ("" = default: left as built)
        self.tenant = TENANT_FIELD_DEFAULT if config.tenant == DEFAULT_TENANT else config.tenant
        self.first: MasterClient | None = None  # the setup thread's stub
        self._local = threading.local()
        self._all: list[MasterClient] = []
        self._lock = threading.Lock()
        self._locate_pool: ThreadPoolExecutor | None = None
        self.started = False
        self.closed = False

    # ------------------------------------------------------------------ lifecycle

    def new_stub(self, local: str = "auto") -> MasterClient:
        """A master RPC stub (CURVE per the config's policy; ``local``: as
        :class:`~kvpool.core.rpc_client.MasterClient`'s)."""
        cfg = self.config
        return master_stub(cfg.master_address, cfg.rpc_timeout_s, cfg.curve, cfg.rpc_poll, local)

    def open(self) -> MasterClient:
        """Make the first stub (the setup thread's) and mark the session started."""
        self.first = self.new_stub()
        self.started = True
        return self.first

    def check(self) -> None:
        """Raise StoreError(CLOSED) unless the session is open."""
        if self.closed:
            raise StoreError("client is closed", ErrorCode.CLOSED)
        if not self.started:
            raise StoreError("client is not set up; call setup()", ErrorCode.CLOSED)

    def close(self) -> list[MasterClient]:
        """Refuse further calls; returns the stubs to close (the caller closes
        them once nothing else may use them)."""
        with self._lock:
            self.closed = True
            pool, self._locate_pool = self._locate_pool, None
            stubs = [*self._all, self.first]
            self._all.clear()
        if pool is not None:
            pool.shutdown(wait=False)
        return [s for s in dict.fromkeys(stubs) if s is not None]

    # ------------------------------------------------------------------ calls

    def stub(self) -> MasterClient:
        """This thread's RPC stub (the setup thread reuses the first one)."""
        master = getattr(self._local, "master", None)
        if master is not None:
            return master  # type: ignore[no-any-return]
        self.check()
        assert self.first is not None
        with self._lock:
            if self.closed:
                raise StoreError("client is closed", ErrorCode.CLOSED)
            if not self._all:
                master = self.first
                self._all.append(master)
            elif len(self._all) >= _MAX_STUBS:  # many threads: share (thread-safe)
                master = self._all[threading.get_ident() % _MAX_STUBS]
            else:
                master = self.new_stub()
                self._all.append(master)
        self._local.master = master
        return master

    def scoped(self, request: Request[R]) -> Request[R]:
        """``request`` acting for this client's tenant (the one place a
        request's ``tenant`` field is set; a no-op for the default tenant)."""
        if self.tenant and type(request) in _SCOPED:
            request.tenant = self.tenant  # type: ignore[attr-defined]
        return request

    def call(self, request: Request[R]) -> R:
        """Send ``request`` (:meth:`scoped`) on this thread's stub; its typed
        reply. Raises the StoreError of the master's code (MasterUnreachable
        for RPC failures)."""
        if self.closed:
            raise StoreError("client is closed", ErrorCode.CLOSED)
        if self.tenant:
            self.scoped(request)
        master = getattr(self._local, "master", None)
        if master is None:
            master = self.stub()
        try:
            return master.call(request)  # type: ignore[no-any-return]
        except MasterRPCError as exc:
            raise error_for_code(exc.code, str(exc)) from exc

    def call_quick(self, request: Request[R], timeout_s: float) -> R:
        """``request`` (:meth:`scoped`) on the first stub with a short timeout
        (close-time clean-up, from any thread)."""
        assert self.first is not None
        return self.first.call(self.scoped(request), timeout_s)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ terms

    @property
    def term(self) -> int:
        """The master term (leader epoch) of this thread's last call; 0 for a
        single master, whose grants no failover loses."""
        return self.stub().epoch

    def term_changed(self, term: int) -> bool:
        """Whether a commit of a put granted in master term ``term`` went to
        another term's leader, and is not itself a redo's (done once)."""
        return term != 0 and self.term != term and not getattr(self._local, "redoing", False)

    @contextmanager
    def redoing(self) -> Iterator[None]:
        """Calls made inside are a redo's: their commits do not redo again."""
        self._local.redoing = True
        try:
            yield
        finally:
            self._local.redoing = False

    def send_commit(self, request: Request[R]) -> R:
        """Send a commit (PUT_END, BATCH_PUT_END). One answered
        WRITE_OUTCOME_UNKNOWN (applied at a leader that could not replicate
        it in time, and no successor named since) is sent once more, without
        asking for spare allocations again: a committed key's PUT_END answers
        OK, which the leader holds back until what it shows is replicated."""
        try:
            return self.call(request)
        except MasterUnreachable as exc:
            if exc.code != ErrorCode.WRITE_OUTCOME_UNKNOWN:
                raise
            log.info("%s: %s; sending it again", request.OP.name, exc)
            if isinstance(request, PutEnd) and request.reserve:
                request = PutEnd(request.client_id, request.key)  # type: ignore[assignment]
            elif isinstance(request, BatchPutEnd) and request.reserve:
                request = BatchPutEnd(request.client_id, request.keys)  # type: ignore[assignment]
            return self.call(request)

    def revoke(self, keys: Sequence[str], quiet: bool = False) -> None:
        """PUT_REVOKE of this client's pending puts ``keys`` (best effort; a
        failure is logged, at debug level when ``quiet``)."""
        if not keys:
            return
        try:
            if len(keys) == 1:
                self.call(PutRevoke(self.client_id, keys[0]))
            else:
                self.call(BatchPutRevoke(self.client_id, list(keys)))
        except StoreError as exc:
            if quiet:
                log.debug("giving back %d allocations: %s", len(keys), exc)
            else:
                log.warning("put_revoke %s failed: %s", list(keys[:3]), exc)

    # ------------------------------------------------------------------ locating

    def locate(self, keys: list[str]) -> tuple[BatchGetReplicaListReply, float]:
        """Where ``keys`` are, in BATCH_GET_REPLICA_LIST's form, and the read
        lease's deadline (monotonic; the lease starts no earlier than the
        request). One key is asked with GET_REPLICA_LIST (its reply and a
        per-key refusal put in the batch form), more with BATCH_GET_REPLICA_LIST."""
        t0 = time.monotonic()
        if len(keys) == 1:
            try:
                one = self.call(GetReplicaList(keys[0]))
            except StoreError as exc:
                if exc.code not in _KEY_CODES:
                    raise
                return BatchGetReplicaListReply([int(exc.code)], [0], [[]], 0), float("inf")
            res = BatchGetReplicaListReply(
                [0], [one.size], [one.replicas], one.lease_ttl_ms,
                [one.checksum] if one.checksum is not None else [], one.segments, one.caps)
        else:
            res = self.call(BatchGetReplicaList(keys))
        ttl_ms = res.lease_ttl_ms
        return res, (t0 + ttl_ms / 1000.0 if ttl_ms else float("inf"))

    def locate_later(self, keys: list[str]) -> Future[tuple[BatchGetReplicaListReply, float]]:
        """:meth:`locate` from a helper thread (kept, so each keeps its stub)."""
        with self._lock:
            if self.closed:  # shut down by close(): the typed error, not the pool's
                raise StoreError("client is closed", ErrorCode.CLOSED)
            if self._locate_pool is None:
                self._locate_pool = ThreadPoolExecutor(2, thread_name_prefix="kvpool-locate")
            return self._locate_pool.submit(self.locate, keys)

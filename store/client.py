"""The store client: Put/Get of objects held in the pool, with buffers and replicas.

One :class:`Client` per process. ``setup()`` connects to the master, starts
its transfer server (inside :class:`kvpool.transfer.TransferEngine`) and its
:class:`kvpool.store.segment_host.SegmentHost`, which creates and mounts this
process's segments (``memory_size`` > 0, ``disk_dir``), pings the master and
re-mounts when asked (e.g. after a master restart). ``close()`` unmounts and
releases all of it. This module is the data path.

Hot paths, kept lean on purpose:

- put: one PUT_START (allocates every replica) -> one transfer batch writing
  every replica -> one PUT_END; any failed write -> PUT_REVOKE and raise. A
  small put with default options whose size a reservation is held for (from
  the previous commit's reply) skips PUT_START: the write, then PUT_COMMIT.
- get: one GET_REPLICA_LIST (grants a read lease) -> READ from the nearest
  complete replica (own segment, same host, remote, file last); on a transfer
  failure the next replica; a read that ends after the lease deadline raises
  LEASE_EXPIRED instead of returning bytes that may have been evicted.
- batch forms: one master batch RPC and one transfer batch per call (a
  second transfer batch only for keys whose first replica failed). A batch
  put of one size with default options whose shape reservations are held
  for (from the previous batch commit's reply) skips BATCH_PUT_START: the
  write, then BATCH_PUT_COMMIT.

Segment descriptors are cached per segment id and handed to the engine once,
so the engine keeps its shm mappings / connections across calls.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
import uuid
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    MAX_KEY_LENGTH,
    BatchExist,
    BatchGetReplicaList,
    BatchGetReplicaListReply,
    BatchKeysReply,
    BatchPutCommit,
    BatchPutEnd,
    BatchPutRevoke,
    BatchPutStart,
    BatchPutStartReply,
    BatchRemove,
    BatchReplicaClear,
    BatchReserveReply,
    BatchUpsertStart,
    Checksum,
    CreateCopyTask,
    CreateMoveTask,
    Exist,
    GetReplicaList,
    GetSize,
    ListSegments,
    PutCommit,
    PutEnd,
    PutOptions,
    PutRevoke,
    PutStart,
    QueryTask,
    QueryTaskReply,
    Remove,
    RemoveAll,
    RemoveByRegex,
    ReplicaDescriptor,
    ReplicaStatus,
    Reply,
    Request,
    ReserveReply,
    SegmentDescriptor,
    SegmentInfo,
    SegmentKind,
    Stats,
    StatsReply,
    validate_key,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from kvpool.store._bufutil import (
    alloc_bytes,
    buffer_nbytes,
    checksum_of,
    host_view,
    is_gpu_buffer,
    resolve_checksum_algo,
    verify_checksum,
)
from kvpool.store._fastpath import InlineShm, host_array
from kvpool.store._gpustage import (
    STAGING_MAX_BYTES,
    DeviceStaging,
    gpu_regions,
    plan_copies,
    run_copies,
)
from kvpool.store.config import ClientConfig, ReplicateConfig, SoftPinAction, default_host_id
from kvpool.store.errors import (
    AlreadyExists,
    BufferTooSmall,
    ChecksumMismatch,
    LeaseExpired,
    MasterUnreachable,
    ObjectNotFound,
    StaleEpoch,
    StoreError,
    StoreTimeout,
    TransferFailed,
    error_for_code,
)
from kvpool.store.guard import master_stub
from kvpool.store.located import Located, boot_id
from kvpool.store.segment_host import SegmentHost
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.copy import DEFAULT_SPLIT_MIN_BYTES as _SPLIT_MIN
from kvpool.transfer.copy import parallel_copyto
from kvpool.transfer.gpu import cuda_runtime

__all__ = [
    "Client",
    "ClientConfig",
    "Location",
    "RangeRead",
    "RangeWrite",
    "ReplicaLocation",
    "ReplicateConfig",
    "Reservation",
    "parts_checksum",
    "parts_checksum_ok",
]

log = logging.getLogger(__name__)

_LAZY_BYTES = object()  # batch-read target: "allocate a bytes result when needed"
_SUSPECT_S = 10.0  # how long a segment that failed a read is tried last
_MAX_RPC_SOCKETS = 16  # per client; threads beyond share them
# reservations for single puts (ClientConfig.reserve_single_puts): sizes up to
# this many bytes, this many sizes at most, a few per size (threads putting the
# same size at once each find one instead of giving back the surplus)
_RESERVE_MAX_SIZE = 1 << 20
_RESERVE_MAX_SIZES = 8
_RESERVE_PER_SIZE = 4
_RESERVE_CLOSE_TIMEOUT_S = 0.5  # close() gives reservations back best effort
# reservations for batch puts (ClientConfig.reserve_batch_puts): one batch's
# worth of a size (up to this many bytes: the round trip saved matters less
# as the bytes grow), a few batches' per size
_BATCH_RESERVE_MAX_BYTES = 1 << 20
_BATCH_RESERVE_PER_SIZE = 4
# batch_get_into_parts: locate part 0's keys by an RPC of their own, and the
# rest's from a helper thread while part 0 moves (False: one RPC for all)
SPLIT_PART_LOCATE = True
# A Located handed to batch_get_into_parts is used for part 0 only with at
# least this much of its read lease left, or half the lease where that is
# shorter (else part 0's keys are located anew).
LOCATED_MIN_LEFT_S = 2.0
_COMPLETE = ReplicaStatus.COMPLETE
_COPIED = (True, "")
_OK = ErrorCode.OK
_STR_ONLY = {str}
_ONE_ONLY = {1}
_HANDLE_ONLY = {BufferHandle}
_LENGTH = operator.attrgetter("length")  # a registered buffer's size, without a call per key
_STALE = int(ErrorCode.STALE_EPOCH)
_UNREAD = int(ErrorCode.INTERNAL_ERROR)  # a batch read's result before the key is decided
_UNSET: Any = object()
_BIG_COPY = 1 << 20  # InlineShm decides per segment and size bucket (below / from 1 MiB)
_NO_CAPS: list[bytes] = []
R = TypeVar("R", bound=Reply)
_DEFAULT_OPTIONS = PutOptions()


@dataclass(slots=True)
class _ReadPlan:
    """Where one key's bytes can be read from, nearest replica first; ``caps``
    are the capability tokens the replicas point at."""

    size: int
    checksum: Checksum
    deadline: float  # monotonic time the read lease ends
    replicas: list[ReplicaDescriptor]
    caps: list[bytes]


def _master_error(exc: MasterRPCError) -> StoreError:
    return error_for_code(exc.code, str(exc))


@dataclass(slots=True)
class _Reserved:
    """A reservation the master handed this client (ReserveReply) for its
    next single put of ``size`` bytes."""

    placeholder: str
    replicas: list[ReplicaDescriptor]
    segments: dict[str, SegmentDescriptor]
    caps: list[bytes]
    deadline: float  # monotonic time after which no write into it may start
    term: int  # master term that granted it

    @property
    def placeholders(self) -> list[str]:
        return [self.placeholder]


@dataclass(slots=True)
class _BatchReserved:
    """Reservations a batch commit's reply (BatchReserveReply) handed this
    client for its next batch put of ``size``-byte values: ``placeholders[i]``
    is written at ``replicas[i]``."""

    placeholders: list[str]
    replicas: list[ReplicaDescriptor]
    segments: dict[str, SegmentDescriptor]
    caps: list[bytes]
    deadline: float  # monotonic time after which no write into them may start
    term: int  # master term that granted them


# a reservation table's entry: held per size, given back by placeholders
_Held = TypeVar("_Held", _Reserved, _BatchReserved)


@dataclass(slots=True)
class _Owned:
    """Everything a Client must release. Its finalizer holds this, never the
    Client, so a Client dropped without close() is collected and released."""

    host: SegmentHost
    rpc_lock: threading.Lock
    rpc_all: list[MasterClient] = field(default_factory=list)
    master: MasterClient | None = None
    engine: Any = None
    inline: InlineShm | None = None
    staging: DeviceStaging | None = None


def _release(owned: _Owned) -> None:
    """Unmount, stop serving, free the memory, close the sockets (in that
    order), each step whatever the previous one raised. Runs once: from
    close(), when the Client is collected, or at interpreter exit."""
    host = owned.host
    if not host.owned_here():
        return  # a forked child's copy: the segments, guard and sockets are the parent's
    host.stop()
    host.unmount()
    host.detach()
    if owned.inline is not None:
        owned.inline.close()
    if owned.staging is not None:
        owned.staging.close()
    host.release_segments()
    if owned.engine is not None:
        try:
            owned.engine.close()
        except Exception as exc:
            log.warning("closing transfer engine: %s", exc)
    with owned.rpc_lock:
        stubs = [*owned.rpc_all, owned.master]
        owned.rpc_all.clear()
    for m in stubs:
        if m is not None:
            m.close()
    host.close_stubs()
    host.close_guard()


class Client:
    """A store client (see module docstring). Thread-safe for concurrent calls.

    Use as a context manager, or call :meth:`setup` then :meth:`close`.
    """

    def __init__(self, config: ClientConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = ClientConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a ClientConfig or keyword overrides, not both")
        config.validate()
        self.config = config
        self.client_id = uuid.uuid4().hex
        self.host_id = config.host_id or default_host_id()
        self._master: MasterClient | None = None
        # one RPC socket per calling thread, so threads do not queue behind
        # each other's round trips (MasterClient serialises calls on a socket)
        self._rpc_local = threading.local()
        self._rpc_all: list[MasterClient] = []
        self._rpc_lock = threading.Lock()
        self._locate_pool: ThreadPoolExecutor | None = None
        self._engine: Any = None
        # the segments this client owns, their mount and liveness (segment_host.py)
        self._host = SegmentHost(
            config, self.client_id, self.host_id,
            functools.partial(master_stub, config.master_address, config.rpc_timeout_s,
                              config.curve),
            self._learn_segments)
        self._own_descs: dict[str, SegmentDescriptor] = self._host.descs
        self._owned = _Owned(self._host, self._rpc_lock, self._rpc_all)
        # close(), garbage collection or interpreter exit: whichever comes first
        self._finalizer = weakref.finalize(self, _release, self._owned)
        self._known: dict[str, SegmentDescriptor] = {}  # segment descriptors given to the engine
        self._known_lock = threading.Lock()
        # segment id -> monotonic time until which its replicas are tried last
        # (a read from it just failed or timed out: e.g. its owner died)
        self._suspect: dict[str, float] = {}
        self._closed = False
        self._started = False
        self._checksum_algo = resolve_checksum_algo(config.checksum)
        self._transfer_mod: Any = None
        self._inline: InlineShm | None = None
        self._gpu_segments_learned = False  # see _learn_memory_segments
        self._staging_lock = threading.Lock()  # creates self._owned.staging once
        # size -> reservations for the next single puts of that size, the size
        # least recently granted one first (see _put_reserved)
        self._reserved: OrderedDict[int, list[_Reserved]] = OrderedDict()
        self._reserved_lock = threading.Lock()
        # size -> reservations for the next batch puts of that size (see
        # _batch_put_reserved), as for single puts
        self._batch_reserved: OrderedDict[int, list[_BatchReserved]] = OrderedDict()

    # ------------------------------------------------------------------ lifecycle

    @property
    def segment_ids(self) -> list[str]:
        """Ids of the segments this client contributes (empty for a pure client)."""
        return self._host.segment_ids

    @property
    def shm_names(self) -> list[str]:
        """/dev/shm names of this client's memory segments."""
        return self._host.shm_names

    @property
    def endpoint(self) -> str:
        """This process's transfer server (``tcp://host:port``)."""
        return str(self._engine.endpoint) if self._engine is not None else ""

    @property
    def engine(self) -> Any:
        """The underlying :class:`kvpool.transfer.TransferEngine`."""
        self._check_open()
        return self._engine

    @property
    def remount_count(self) -> int:
        """How many times the ping thread re-mounted after the master asked."""
        return self._host.remounts

    @property
    def segment_host(self) -> SegmentHost:
        """The owner of this client's segments: liveness, guard, janitor."""
        return self._host

    def setup(self) -> Client:
        """Connect, create and mount segments, start the transfer server and pinger.

        Raises :class:`MasterUnreachable` if the master does not answer within
        ``rpc_timeout_s``; on any failure everything created so far is released.
        """
        if self._started:
            return self
        if self._closed:
            raise StoreError("client is closed", ErrorCode.CLOSED)
        self._started = True
        try:
            self._setup()
        except StoreError:
            self.close()
            raise
        except KVPoolError as exc:  # e.g. a TransferError creating the segment: typed
            self.close()
            raise error_for_code(exc.code, f"setup failed: {exc}") from exc
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        import kvpool.transfer as transfer  # lazy: keeps `import kvpool.store` light

        self._transfer_mod = transfer
        cfg = self.config
        self._master = self._owned.master = self._new_master()
        # Fail fast (typed) when the master is not there, before allocating memory.
        try:
            self._host.check_master()
        except MasterRPCError as exc:
            raise MasterUnreachable(
                f"master {cfg.master_address} unreachable: {exc}", exc.code
            ) from exc
        tcfg = transfer.load_transfer_config(cfg.transfer_config, cfg.transfer_overrides or None)
        self._engine = transfer.TransferEngine(
            tcfg, host_id=self.host_id, bind_host=cfg.bind_host, port=cfg.transfer_port,
            curve=cfg.curve,
        )
        self._owned.engine = self._engine
        self._inline = self._owned.inline = InlineShm(list(tcfg.rules), self.host_id,
                                                      cfg.inline_shm)
        port = self._engine.endpoint.rsplit(":", 1)[-1]
        base_id = cfg.segment_id or f"{self.host_id}:{port}"
        self._host.create_segments(self._engine, self._inline, base_id)
        self._host.start(self._master)
        log.info(
            "client %s up: host %s, segments %s, endpoint %s",
            self.client_id[:8], self.host_id, list(self._own_descs), self._engine.endpoint,
        )

    def _new_master(self) -> MasterClient:
        """A master RPC stub (CURVE per the config's policy)."""
        cfg = self.config
        return master_stub(cfg.master_address, cfg.rpc_timeout_s, cfg.curve)

    def close(self) -> None:
        """Unmount this client's segments and release every resource. Idempotent.

        A Client that is garbage-collected, or still open at interpreter exit,
        is released the same way; one whose process dies (SIGTERM's default
        action, kill -9) is released by its guard process."""
        if self._closed:
            return
        self._give_back_reservations(self._reserved, "reservations")
        self._give_back_reservations(self._batch_reserved, "batch reservations")
        self._closed = True
        with self._rpc_lock:  # a _locator() call either made its pool already or refuses
            pool = self._locate_pool
        if pool is not None:
            pool.shutdown(wait=False)
        self._finalizer()

    def __enter__(self) -> Client:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("client is closed", ErrorCode.CLOSED)
        if not self._started:
            raise StoreError("client is not set up; call setup()", ErrorCode.CLOSED)

    # ------------------------------------------------------------------ helpers

    def _call(self, request: Request[R]) -> R:
        self._check_open()
        master = getattr(self._rpc_local, "master", None)
        if master is None:
            master = self._thread_master()
        try:
            return master.call(request)
        except MasterRPCError as exc:
            raise _master_error(exc) from exc

    def _thread_master(self) -> MasterClient:
        """This thread's RPC stub (the setup thread reuses the first one)."""
        assert self._master is not None
        with self._rpc_lock:
            if self._closed:
                raise StoreError("client is closed", ErrorCode.CLOSED)
            if not self._rpc_all:
                master = self._master
                self._rpc_all.append(master)
            elif len(self._rpc_all) >= _MAX_RPC_SOCKETS:  # many threads: share (thread-safe)
                master = self._rpc_all[threading.get_ident() % _MAX_RPC_SOCKETS]
            else:
                master = self._new_master()
                self._rpc_all.append(master)
        self._rpc_local.master = master
        return master

    def _learn_segments(self, segments: dict[str, SegmentDescriptor]) -> None:
        """Hand new segment descriptors to the engine (once per segment id)."""
        if not segments:
            return
        for seg_id, desc in segments.items():
            known = self._known.get(seg_id)
            if known is not None and known.name == desc.name \
                    and known.client_id == desc.client_id:
                continue
            with self._known_lock:
                known = self._known.get(seg_id)
                if known is not None:
                    if known.name == desc.name and known.client_id == desc.client_id:
                        continue
                    # the id now names another region (its owner came back with
                    # the same segment id): drop every cached mapping of the old one
                    self._engine.remove_peer_segment(seg_id)
                    if self._inline is not None and seg_id not in self._own_descs:
                        self._inline.forget(seg_id)
                self._engine.add_peer_segment(desc)
                self._known[seg_id] = desc

    def _forget_segment(self, seg_id: str) -> None:
        """Drop a cached mapping after a failure so the next use re-learns it,
        and try that segment's replicas last for a while."""
        self._suspect[seg_id] = time.monotonic() + _SUSPECT_S
        if self._inline is not None and seg_id not in self._own_descs:
            self._inline.forget(seg_id)
        with self._known_lock:
            if self._known.pop(seg_id, None) is not None:
                try:
                    self._engine.remove_peer_segment(seg_id)
                except Exception as exc:
                    log.debug("remove_peer_segment %s: %s", seg_id, exc)

    def _rank(self, seg_id: str) -> int:
        """Replica preference: own segment, same-host memory, remote memory, file."""
        desc = self._known.get(seg_id)
        if desc is None:
            return 5
        if self._suspect and self._suspect.get(seg_id, 0.0) > time.monotonic():
            return 10
        file = 3 if desc.kind == SegmentKind.FILE else 0
        if desc.client_id == self.client_id:
            return 0 + file
        if desc.host_id == self.host_id:
            return 1 + file
        return 2 + file

    def _checksum(self, buf: Any) -> str | None:
        if self._checksum_algo is None:
            return None
        view = host_view(buf)
        return None if view is None else checksum_of(self._checksum_algo, view)

    def _transfer(self, reqs: list[Any], timeout: float) -> list[Any]:
        try:
            return list(self._engine.transfer(reqs, timeout=timeout))
        except KVPoolError as exc:
            if exc.code in (ErrorCode.TIMEOUT, ErrorCode.RPC_TIMEOUT):
                raise StoreTimeout(f"transfer did not finish within {timeout:.1f}s", exc.code
                                   ) from exc
            raise TransferFailed(str(exc), ErrorCode.TRANSFER_FAIL) from exc

    def _run(self, reqs: list[Any], timeout: float) -> list[Any]:
        """Run a read batch for at most ``timeout``; requests still running then
        are reported FAILED with code TIMEOUT (the caller moves on to another
        replica instead of waiting on a dead peer)."""
        try:
            return list(self._engine.run(reqs, timeout))
        except KVPoolError as exc:
            raise TransferFailed(str(exc), ErrorCode.TRANSFER_FAIL) from exc

    # ------------------------------------------------------------------ put

    @staticmethod
    def _put_options(config: ReplicateConfig | None) -> PutOptions | None:
        """The placement a config stands for (None: every default)."""
        if config is None:
            return None
        soft = bool(config.pins_soft)
        ttl = config.soft_pin_ttl_ms
        opts = PutOptions(int(config.replica_num),
                          int(config.disk_replica_num) + int(config.nof_replica_num),
                          config.segments(), bool(config.with_hard_pin), soft,
                          int(ttl) if soft and ttl is not None else -1,
                          not soft and config.soft_pin_action == SoftPinAction.DISABLE)
        return None if opts == _DEFAULT_OPTIONS else opts

    @staticmethod
    def _groups(config: ReplicateConfig | None, n: int) -> list[str] | None:
        """``config.group_ids`` (one object group per key) checked against ``n`` keys."""
        if config is None or config.group_ids is None:
            return None
        groups = [str(g) for g in config.group_ids]
        if len(groups) != n:
            raise StoreError(f"group_ids has {len(groups)} entries for {n} keys",
                             ErrorCode.INVALID_PARAMS)
        return groups

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> None:
        """Store ``value`` (bytes-like or any buffer) under ``key``.

        Raises AlreadyExists (value unchanged), NoSpace, TransferFailed (the
        put was revoked), MasterUnreachable, StoreTimeout, StoreError(INVALID_KEY).
        """
        self.put_from(key, value, config)

    def put_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> None:
        """Store the bytes of ``buffer`` (host or GPU, raw or a registered BufferHandle)
        under ``key`` without an intermediate copy. Errors as :meth:`put`; a
        write refused for a grant of an older master term (HA failover) is
        revoked and the put asked of the master once more (then StaleEpoch), and
        a put whose reservation a master failover lost before its commit is
        done again at the new leader, once (see :meth:`_commit_batch`)."""
        self._check_open()
        self._valid_key(key)
        size = buffer_nbytes(buffer)
        if size <= 0:
            raise StoreError("cannot put an empty value", ErrorCode.INVALID_PARAMS)
        checksum = self._checksum(buffer) if self._checksum_algo is not None else None
        groups = self._groups(config, 1)
        # a small put with every default: a reservation of its size, when held,
        # saves PUT_START; its commit asks for the next one
        reserve = size if (size <= _RESERVE_MAX_SIZE and self.config.reserve_single_puts
                           and checksum is None and groups is None
                           and (config is None or self._put_options(config) is None)
                           and not is_gpu_buffer(buffer)) else 0
        if reserve:
            held = self._take_reserved(size)
            if held is not None and self._put_reserved(key, buffer, size, held):
                return
        try:
            self._put_once(key, buffer, size, config, checksum, groups, reserve)
        except (StaleEpoch, _ReservationLost) as exc:
            log.info("put %r: %s; asking the master again", key, exc)
            self._put_once(key, buffer, size, config, checksum, groups, reserve)

    def _put_once(self, key: str, buffer: Any, size: int, config: ReplicateConfig | None,
                  checksum: Any, groups: list[str] | None, reserve: int = 0) -> None:
        res = self._call(PutStart(self.client_id, key, size, self._put_options(config),
                                  checksum, None if groups is None else groups[0]))
        term = self._term()
        self._learn_segments(res.segments)
        replicas = res.replicas
        try:
            codes: list[ErrorCode] = []
            results = self._copy_batch(True, [(buffer, r, size) for r in replicas],
                                       self.config.transfer_timeout_s, res.caps, codes)
            failed = [(r, err) for r, (ok, err) in zip(replicas, results, strict=True) if not ok]
            if failed and ErrorCode.STALE_EPOCH in codes:
                raise StaleEpoch(f"put {key!r}: a node refused the grant as of an older "
                                 "master term: " + "; ".join(err for _r, err in failed))
            if failed or not replicas:
                for r, _ in failed:
                    self._forget_segment(r.segment_id)
                raise TransferFailed(
                    f"put {key!r}: {len(failed)}/{len(replicas)} replica writes failed: "
                    + "; ".join(f"{r.segment_id}: {err}" for r, err in failed)
                )
        except BaseException:
            self._revoke([key])
            raise
        self._commit_one(key, term, reserve)

    # ------------------------------------------------------------------ reserved single puts
    # A commit's reply may carry a reservation: an anonymous pending put of the
    # size asked for, placed and granted by the master. The next put of that
    # size writes into it and names the key with one PUT_COMMIT. A reservation
    # is used once (taken out of the table before the write), only while its
    # ttl runs and in the master term that granted it; whatever goes wrong with
    # it, the put is done from the start as if there had been none.

    def _keep_reserved(self, res: ReserveReply, size: int, term: int) -> None:
        """Hold the reservation of a commit's reply (if any) for ``size``."""
        if not res.placeholder:
            return
        r = _Reserved(res.placeholder, res.replicas, res.segments, res.caps,
                      time.monotonic() + res.ttl_ms / 1000.0, term)
        self._hold(size, r)

    def _hold(self, size: int, r: _Reserved) -> None:
        """Keep ``r`` for ``size``; what does not fit is given back."""
        self._hold_in(self._reserved, _RESERVE_PER_SIZE, size, r)

    def _hold_in(self, table: OrderedDict[int, list[_Held]], per_size: int, size: int,
                 r: _Held) -> None:
        """Keep ``r`` for ``size`` in ``table`` (``per_size`` a size and
        _RESERVE_MAX_SIZES sizes at most); what does not fit is given back."""
        drop: list[_Held] = []
        with self._reserved_lock:
            held = table.pop(size, None) or []
            if len(held) < per_size:
                held.append(r)
            else:
                drop.append(r)
            table[size] = held  # the most recent size last
            while len(table) > _RESERVE_MAX_SIZES:
                drop += table.popitem(last=False)[1]
        if drop:
            self._unreserve([p for d in drop for p in d.placeholders])

    def _usable(self, r: _Held) -> _Held | None:
        """``r``, just taken, when it may still be written (within its ttl, in
        the master term that granted it); else None, and it is given back."""
        if time.monotonic() >= r.deadline or r.term != self._term():
            self._unreserve(r.placeholders)
            return None
        return r

    def _take_reserved(self, size: int) -> _Reserved | None:
        """The reservation held for ``size``, taken (no other put may use it);
        None when there is none still usable (an expired one is given back)."""
        if not self._reserved:
            return None
        with self._reserved_lock:
            held = self._reserved.get(size)
            if not held:
                return None
            r = held.pop()  # the newest: the longest ttl left
            if not held:
                del self._reserved[size]
        return self._usable(r)

    def _put_reserved(self, key: str, buffer: Any, size: int, r: _Reserved) -> bool:
        """Put ``key`` through reservation ``r``: write, then PUT_COMMIT (asking
        for the next reservation). False: the reservation could not be used
        (a failed write, revoked; or the master no longer holds it) and nothing
        was stored: the caller puts from the start. Raises AlreadyExists (the
        reservation is kept) and what a commit raises."""
        self._learn_segments(r.segments)
        replicas = r.replicas
        try:
            results = self._copy_batch(True, [(buffer, rep, size) for rep in replicas],
                                       self.config.transfer_timeout_s, r.caps)
        except BaseException:
            self._unreserve([r.placeholder])
            raise
        failed = [(rep, err) for rep, (ok, err) in zip(replicas, results, strict=True) if not ok]
        if failed or not replicas:
            for rep, _ in failed:
                self._forget_segment(rep.segment_id)
            log.info("put %r: write into a reservation failed (%s); putting from the start",
                     key, "; ".join(err for _r, err in failed))
            self._unreserve([r.placeholder])
            return False
        try:
            try:
                res = self._call(PutCommit(self.client_id, r.placeholder, key, size))
            except MasterUnreachable as exc:
                if exc.code != ErrorCode.WRITE_OUTCOME_UNKNOWN:
                    raise
                # applied, maybe: the key's own PUT_END answers OK once it is replicated,
                # OBJECT_NOT_FOUND when it was not applied (then put from the start)
                log.info("PUT_COMMIT %r: %s; confirming with PUT_END", key, exc)
                self._send_commit(PutEnd(self.client_id, key))
                return True
        except ObjectNotFound as exc:  # expired, or lost to a master failover or restart
            log.info("put %r: reservation gone (%s); putting from the start", key, exc)
            return False
        except AlreadyExists:
            self._hold(size, r)  # still reserved at the master: usable for another key
            raise
        self._keep_reserved(res, size, self._term())
        return True

    def _unreserve(self, placeholders: list[str]) -> None:
        """Give reservations back (PUT_REVOKE); one the master swept already
        answers OBJECT_NOT_FOUND, which is fine."""
        self._revoke(placeholders, reservations=True)

    def _give_back_reservations(self, table: OrderedDict[int, list[_Held]],
                                what: str) -> None:
        """close(): revoke the reservations held in ``table`` (best effort, a
        short timeout; a client that dies instead has them released with its
        other puts)."""
        with self._reserved_lock:
            held = [p for rs in table.values() for r in rs for p in r.placeholders]
            table.clear()
        if not held or not self._started or self._master is None:
            return
        try:
            self._master.call(BatchPutRevoke(self.client_id, held), _RESERVE_CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing regardless
            log.debug("revoking %d %s at close: %s", len(held), what, exc)

    def _copy_batch(self, write: bool, jobs: list[tuple[Any, ReplicaDescriptor, int]],
                    timeout: float, caps: list[bytes],
                    codes: list[ErrorCode] | None = None) -> list[tuple[bool, str]]:
        """Copy every ``(buffer, replica, size)`` job: same-host shm copies inline
        (see ``_fastpath``), the rest as ONE engine batch (each request with the
        capability token of ``caps`` its replica points at). Returns ``(ok, error)``
        per job, the shared ``_COPIED`` for every job that succeeded;
        ``codes``, when given, gets each job's ErrorCode (OK when
        copied). Writes raise StoreTimeout when the batch overruns ``timeout``;
        reads report the overrunning requests as failed (TIMEOUT)."""
        if codes is not None:
            codes[:] = [ErrorCode.OK] * len(jobs)
        results: list[tuple[bool, str]] = [_COPIED] * len(jobs)
        via_engine: list[int] = []
        inline = self._inline
        if inline is None or not inline.enabled:
            via_engine = list(range(len(jobs)))
        else:
            known = self._known
            # the mapped region per (segment, size bucket): None = not inline;
            # the last one is kept at hand (a batch mostly names one segment)
            regions: dict[tuple[str, bool], Any] = {}
            last_sid: str | None = None
            last_big = False
            region: Any = None
            rview: Any = None
            rsize = 0
            copied = 0
            for j, (buf, r, size) in enumerate(jobs):
                sid = r.segment_id
                big = size >= _BIG_COPY
                if sid != last_sid or big != last_big:
                    rkey = (sid, big)
                    region = regions.get(rkey, _UNSET)
                    if region is _UNSET:
                        region = regions[rkey] = inline.target(known.get(sid), size)
                    last_sid, last_big = sid, big
                    rsize = 0 if region is None else region.size
                    # a small copy through memoryviews: half the time of a numpy
                    # slice assignment (a 4 KiB key: ~160 against ~310 ns)
                    rview = None if region is None else memoryview(region)
                if region is None:
                    via_engine.append(j)
                    continue
                if type(buf) is BufferHandle and buf.device != "cuda" \
                        and type(buf.array) is np.ndarray and buf.array.size == buf.length:
                    # a registered host buffer (the common case): host_array, inline
                    arr: np.ndarray | None = buf.array
                    if not write and buf.readonly:  # (a stale flag: the copy raises)
                        via_engine.append(j)
                        continue
                else:
                    arr = host_array(buf)
                    if arr is None or not (write or arr.flags.writeable):
                        via_engine.append(j)
                        continue
                off = r.offset
                assert arr is not None
                if arr.size < size or off < 0 or off + size > rsize:
                    via_engine.append(j)
                    continue
                try:
                    if arr.size != size:
                        arr = arr[:size]
                    if size < _SPLIT_MIN:  # parallel_copyto's own small-copy path, inline
                        try:  # (bytes of a 1-D uint8 array: the registered buffers)
                            if write:
                                rview[off:off + size] = arr
                            else:
                                arr.data[:] = rview[off:off + size]
                        except (ValueError, TypeError):  # another layout: numpy copies it
                            if write:
                                region[off:off + size] = arr
                            else:
                                arr[...] = region[off:off + size]
                    elif write:
                        parallel_copyto(region[off:off + size], arr)
                    else:
                        parallel_copyto(arr, region[off:off + size])
                    copied += 1
                except Exception as exc:  # fall back to the engine's transports
                    log.debug("inline shm %s of %s failed: %s",
                              "write" if write else "read", sid, exc)
                    via_engine.append(j)
            inline.copies += copied
        if via_engine:
            via_engine = self._copy_gpu_direct(write, jobs, via_engine)
        if via_engine:
            t = self._transfer_mod
            top = t.TransferOp.WRITE if write else t.TransferOp.READ
            make = t.TransferRequest
            reqs = []
            for j in via_engine:
                buf, r, size = jobs[j]
                k = r.cap
                reqs.append(make(top, buf, r.segment_id, r.offset, size, 0, None,
                                 caps[k] if k >= 0 else b""))
            statuses = self._transfer(reqs, timeout) if write else self._run(reqs, timeout)
            for j, st in zip(via_engine, statuses, strict=True):
                if st.ok:
                    continue  # results[j] is _COPIED already
                results[j] = (False, "; ".join(st.errors) or st.code.name)
                if codes is not None:
                    codes[j] = st.code
        return results

    def _copy_gpu_direct(self, write: bool, jobs: list[tuple[Any, ReplicaDescriptor, int]],
                         todo: list[int]) -> list[int]:
        """Copy the jobs of ``todo`` that are registered GPU buffers and same-host
        memory segments straight through the engine's shm transport (one
        stream, one wait: no per-request work items); the rest, or all of them
        when that path does not apply or fails, are returned for the engine."""
        gpu = [j for j in todo if type(jobs[j][0]) is BufferHandle and jobs[j][0].device == "cuda"]
        if not gpu:
            return todo
        try:
            done = self._engine.copy_gpu_shm(
                [(jobs[j][0], jobs[j][1].segment_id, jobs[j][1].offset, jobs[j][2]) for j in gpu],
                write)
        except KVPoolError as exc:  # the engine path retries and reports per request
            log.debug("direct GPU shm %s failed: %s", "write" if write else "read", exc)
            return todo
        if not done:
            return todo
        if len(gpu) == len(todo):
            return []
        moved = set(gpu)
        return [j for j in todo if j not in moved]

    def _revoke(self, keys: list[str], reservations: bool = False) -> None:
        """PUT_REVOKE of this client's pending puts ``keys`` (best effort; a
        failure is logged, at debug level for ``reservations`` given back)."""
        if not keys:
            return
        try:
            if len(keys) == 1:
                self._call(PutRevoke(self.client_id, keys[0]))
            else:
                self._call(BatchPutRevoke(self.client_id, keys))
        except StoreError as exc:
            if reservations:
                log.debug("giving back %d reservations: %s", len(keys), exc)
            else:
                log.warning("put_revoke %s failed: %s", keys[:3], exc)

    @staticmethod
    def _valid_key(key: Any) -> str:
        try:
            return validate_key(key)
        except KVPoolError as exc:
            raise StoreError(str(exc), ErrorCode.INVALID_KEY) from exc

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> list[ErrorCode]:
        """Put many values: one BATCH_PUT_START, one transfer batch, one BATCH_PUT_END.

        Returns a per-key :class:`ErrorCode` (OK, OBJECT_ALREADY_EXISTS,
        NO_AVAILABLE_HANDLE, TRANSFER_FAIL, INVALID_KEY, ...). Raises only for
        call-level failures (MasterUnreachable, closed client, length mismatch).
        """
        return self.batch_put_from(keys, values, config)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any],
                       config: ReplicateConfig | None = None,
                       upsert: bool = False) -> list[ErrorCode]:
        """Zero-copy :meth:`put_batch` from host or GPU buffers. Same result
        contract. ``upsert``: insert or replace (:meth:`batch_put_reserve`).
        A batch of one size with every default may write into reservations the
        previous batch's commit handed out and commit with one master call
        (``ClientConfig.reserve_batch_puts``; see :meth:`_batch_put_reserved`)."""
        return self._batch_put_from(keys, buffers, config, upsert, True)

    def _batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any],
                        config: ReplicateConfig | None, upsert: bool,
                        reserved: bool) -> list[ErrorCode]:
        """:meth:`batch_put_from`; ``reserved``: may use and ask for reservations."""
        self._check_open()
        if len(keys) != len(buffers):
            raise StoreError(f"{len(keys)} keys but {len(buffers)} buffers",
                             ErrorCode.INVALID_PARAMS)
        n = len(keys)
        codes: list[ErrorCode] = [ErrorCode.OK] * n
        if n == 0:
            return codes
        groups = self._groups(config, n)
        put_keys: list[str] = []
        put_sizes: list[int] = []
        idx: Sequence[int] = []  # position in the request -> key index
        checksums: list[Checksum] | None = [] if self._checksum_algo is not None else None
        sizes: list[int] | None = None
        # (the key checks map C callables: no Python frame per key)
        if checksums is None and set(map(type, keys)) == _STR_ONLY \
                and 0 < min(map(len, keys)) and max(map(len, keys)) <= MAX_KEY_LENGTH \
                and len(set(keys)) == n:
            sizes = list(map(_LENGTH, buffers)) if set(map(type, buffers)) == _HANDLE_ONLY \
                else list(map(buffer_nbytes, buffers))
        if sizes is not None and min(sizes) > 0:
            # every key valid and distinct, every buffer non-empty (the common case)
            put_keys, put_sizes, idx = list(keys), sizes, range(n)
        else:
            idx = self._put_positions(keys, buffers, sizes, codes, put_keys, put_sizes,
                                      checksums)
        if not idx:
            return codes
        # one size, every default: reservations of this batch's shape skip
        # BATCH_PUT_START (held ones), or are asked of its commit
        reserve = 0
        if reserved and not upsert and checksums is None and groups is None \
                and self.config.reserve_batch_puts and type(idx) is range \
                and put_sizes.count(put_sizes[0]) == n \
                and put_sizes[0] * n <= _BATCH_RESERVE_MAX_BYTES \
                and (config is None or self._put_options(config) is None):
            reserve = put_sizes[0]
            held = self._take_batch_reserved(reserve, n)
            if held is not None:
                return self._batch_put_reserved(put_keys, buffers, reserve, held, config)
        start = BatchUpsertStart if upsert else BatchPutStart
        res = self._call(start(self.client_id, put_keys, put_sizes, self._put_options(config),
                               checksums, None if groups is None else [groups[i] for i in idx]))
        term = self._term()
        self._learn_segments(res.segments)
        jobs: list[tuple[Any, ReplicaDescriptor, int]]
        owner: Sequence[int]  # job -> key index
        ok_pos: Sequence[int]  # request positions whose PUT_START succeeded
        replicas = res.replicas
        if not any(res.codes) and len(replicas) == len(idx) \
                and set(map(len, replicas)) == _ONE_ONLY:
            # every key reserved, one replica each (the common case): one job per key
            jobs = [(buffers[i], reps[0], size)
                    for i, reps, size in zip(idx, replicas, put_sizes, strict=True)]
            owner = idx
            ok_pos = range(len(idx))
        else:
            jobs, owner, ok_pos = self._put_jobs(res, idx, buffers, put_sizes, codes)
        try:
            results = self._copy_batch(True, jobs, self.config.transfer_timeout_s, res.caps)
        except BaseException:
            self._revoke([put_keys[pos] for pos in ok_pos])
            raise
        failed = results.count(_COPIED) != len(results)  # the shared success value
        if failed:
            for j, res_j in enumerate(results):
                if res_j is not _COPIED:
                    codes[owner[j]] = ErrorCode.TRANSFER_FAIL
                    self._forget_segment(jobs[j][1].segment_id)
        done: Sequence[int]
        if failed:
            done = [pos for pos in ok_pos if codes[idx[pos]] == ErrorCode.OK]
            self._revoke([put_keys[pos] for pos in ok_pos
                          if codes[idx[pos]] == ErrorCode.TRANSFER_FAIL])
        else:
            done = ok_pos
        if done:
            every = len(done) == len(put_keys)  # (the common case: no per-key lists)
            at: Sequence[int] = idx if every else [idx[pos] for pos in done]
            ends = self._commit_batch(
                put_keys if every else [put_keys[pos] for pos in done], term, upsert,
                lambda lost: self.batch_put_from(
                    [keys[at[p]] for p in lost], [buffers[at[p]] for p in lost],
                    _config_for(config, [at[p] for p in lost]), upsert),
                reserve if every else 0)
            for i, code in zip(at, ends, strict=True):
                codes[i] = code
        return codes

    def _put_jobs(self, res: BatchPutStartReply, idx: Sequence[int], buffers: Sequence[Any],
                  put_sizes: list[int], codes: list[ErrorCode]
                  ) -> tuple[list[tuple[Any, ReplicaDescriptor, int]], list[int], list[int]]:
        """The copy jobs of a BATCH_PUT_START reply: ``(jobs, owner, ok_pos)``
        with a job per replica of each reserved key, the key index of each job
        and the request positions reserved; sets ``codes`` of the keys refused."""
        jobs: list[tuple[Any, ReplicaDescriptor, int]] = []
        owner: list[int] = []
        ok_pos: list[int] = []
        for pos, (code, reps) in enumerate(zip(res.codes, res.replicas, strict=True)):
            i = idx[pos]
            if code:
                codes[i] = self._code(code)
                continue
            ok_pos.append(pos)
            buf = buffers[i]
            size = put_sizes[pos]
            for r in reps:
                jobs.append((buf, r, size))
                owner.append(i)
        return jobs, owner, ok_pos

    def _put_positions(self, keys: Sequence[str], buffers: Sequence[Any],
                       sizes: list[int] | None,
                       codes: list[ErrorCode], put_keys: list[str], put_sizes: list[int],
                       checksums: list[Checksum] | None) -> list[int]:
        """The keys of a batch put that go to the master, checked one by one:
        fills ``put_keys``/``put_sizes`` (and ``checksums``), sets ``codes`` of
        the others (INVALID_KEY, OBJECT_ALREADY_EXISTS for a repeat in the
        batch, INVALID_PARAMS for an empty buffer); returns their positions."""
        idx: list[int] = []
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if type(key) is not str or not key or len(key) > MAX_KEY_LENGTH:
                codes[i] = ErrorCode.INVALID_KEY
                continue
            if key in seen:  # a second put of the same key in one batch
                codes[i] = ErrorCode.OBJECT_ALREADY_EXISTS
                continue
            size = buffer_nbytes(buffers[i]) if sizes is None else sizes[i]
            if size <= 0:
                codes[i] = ErrorCode.INVALID_PARAMS
                continue
            seen.add(key)
            put_keys.append(key)
            put_sizes.append(size)
            if checksums is not None:
                checksums.append(self._checksum(buffers[i]))
            idx.append(i)
        return idx

    @staticmethod
    def _code(code: Any) -> ErrorCode:
        try:
            return ErrorCode(int(code))
        except ValueError:
            return ErrorCode.INTERNAL_ERROR

    # ------------------------------------------------------------------ a put across a failover
    # In-flight reservations are not in the HA replication stream: a master
    # failover between a put's PUT_START (granted by the old leader) and its
    # PUT_END loses the reservation, and the new leader answers the commit
    # OBJECT_NOT_FOUND (or, for an upsert of a key it holds, OK for the old
    # value). Such a put is done again at the current leader, once. The old
    # reservation is not revoked: its space belonged to the old term, and the
    # new leader never counted it as taken.

    def _term(self) -> int:
        """The master term (leader epoch) of this thread's last call; 0 for a
        single master, whose reservations no failover loses."""
        master = getattr(self._rpc_local, "master", None)
        return (master if master is not None else self._thread_master()).epoch

    def _term_changed(self, term: int) -> bool:
        """Whether a commit of a key reserved in master term ``term`` went to
        another term's leader, and is not itself a redo's (done once)."""
        return term != 0 and self._term() != term \
            and not getattr(self._rpc_local, "redoing", False)

    def _send_commit(self, request: Request[R]) -> R:
        """Send a commit (PUT_END, BATCH_PUT_END). One answered
        WRITE_OUTCOME_UNKNOWN (applied at a leader that could not replicate
        it in time, and no successor named since) is sent once more: a
        committed key's PUT_END answers OK, which the leader holds back until
        what it shows is replicated (or a successor answers it, as above)."""
        try:
            return self._call(request)
        except MasterUnreachable as exc:
            if exc.code != ErrorCode.WRITE_OUTCOME_UNKNOWN:
                raise
            log.info("%s: %s; sending it again", request.OP.name, exc)
            if isinstance(request, PutEnd) and request.reserve:
                # not a second reservation: the first one's reply is what was lost
                # (the master drops it with its write window)
                request = PutEnd(request.client_id, request.key)  # type: ignore[assignment]
            elif isinstance(request, BatchPutEnd) and request.reserve:  # (likewise)
                request = BatchPutEnd(request.client_id, request.keys)  # type: ignore[assignment]
            return self._call(request)

    def _commit_one(self, key: str, term: int, reserve: int = 0) -> None:
        """PUT_END of ``key``, reserved in master term ``term`` (``reserve`` > 0:
        asking for a reservation of that size, kept). Raises _ReservationLost
        when a failover lost the reservation (the caller puts again), else what
        PUT_END raises."""
        try:
            res = self._send_commit(PutEnd(self.client_id, key, reserve))
            if res.placeholder:
                self._keep_reserved(res, reserve, self._term())
        except ObjectNotFound as exc:
            if not self._term_changed(term):
                raise
            raise _ReservationLost(f"put {key!r}: the reservation of master term {term} "
                                   f"was lost to a failover: {exc}") from exc

    def _commit_batch(self, keys: list[str], term: int, upsert: bool,
                      redo: Callable[[list[int]], list[ErrorCode]],
                      reserve: int = 0) -> list[ErrorCode]:
        """BATCH_PUT_END of ``keys``, reserved in master term ``term``; per key
        OK or why not. When the commit went to another term's leader, the keys
        answered OBJECT_NOT_FOUND (every committed key of an upsert) are put
        again by ``redo(positions in keys)``, which returns their codes; a
        redo's own commit does not redo again. ``reserve`` > 0: the commit
        asks for reservations of that size for the next batch of as many keys."""
        end = self._send_commit(BatchPutEnd(self.client_id, keys, reserve,
                                            len(keys) if reserve else 0))
        if end.placeholders:  # granted by the leader that answered
            self._keep_batch_reserved(end, reserve, self._term())
        if not any(end.codes):  # every key committed (the common case)
            codes = [_OK] * len(end.codes)
            if not upsert:
                return codes  # nothing lost to a failover
        else:
            codes = [self._code(c) for c in end.codes]
        bad = ErrorCode.OBJECT_NOT_FOUND
        lost = [p for p, c in enumerate(codes) if c == bad or (upsert and c == ErrorCode.OK)]
        if not lost or not self._term_changed(term):
            return codes
        log.info("%d of %d puts reserved in master term %d committed in term %d: "
                 "putting them again", len(lost), len(keys), term, self._term())
        self._rpc_local.redoing = True
        try:
            again = redo(lost)
        finally:
            self._rpc_local.redoing = False
        for p, code in zip(lost, again, strict=True):
            codes[p] = code
        return codes

    # ------------------------------------------------------------------ reserved batch puts
    # A batch commit (BATCH_PUT_END, BATCH_PUT_COMMIT) may ask for reservations
    # of its batch's shape: as many pending puts of its one size under
    # placeholder keys. The next batch put of that size and at most as many
    # keys writes into them and names its keys with one BATCH_PUT_COMMIT (two
    # round trips, not three); the rules are the single puts' (taken before
    # the write, used once, within their ttl and master term), and a key whose
    # reservation fails it (a failed write, one the master no longer holds)
    # is put from the start.

    def _keep_batch_reserved(self, res: BatchReserveReply, size: int, term: int) -> None:
        """Hold the reservations of a batch commit's reply for ``size``, in
        master term ``term`` (the surplus over what is held is given back)."""
        r = _BatchReserved(res.placeholders, res.replicas, res.segments, res.caps,
                           time.monotonic() + res.ttl_ms / 1000.0, term)
        self._hold_in(self._batch_reserved, _BATCH_RESERVE_PER_SIZE, size, r)

    def _take_batch_reserved(self, size: int, n: int) -> _BatchReserved | None:
        """``n`` reservations held for ``size``, taken (no other put may use
        them; what is left of their group stays held); None when no group of
        at least ``n`` is still usable (an expired one is given back)."""
        if not self._batch_reserved:
            return None
        with self._reserved_lock:
            held = self._batch_reserved.get(size)
            if not held or len(held[-1].placeholders) < n:
                return None
            r = held.pop()  # the newest: the longest ttl left
            if len(r.placeholders) > n:  # the rest stays for the next batch
                held.append(_BatchReserved(r.placeholders[n:], r.replicas[n:], r.segments,
                                           r.caps, r.deadline, r.term))
                r = _BatchReserved(r.placeholders[:n], r.replicas[:n], r.segments, r.caps,
                                   r.deadline, r.term)
            elif not held:
                del self._batch_reserved[size]
        return self._usable(r)

    def _batch_put_reserved(self, keys: list[str], buffers: Sequence[Any], size: int,
                            r: _BatchReserved, config: ReplicateConfig | None
                            ) -> list[ErrorCode]:
        """:meth:`batch_put_from` of ``keys`` (valid, distinct, every buffer
        ``size`` bytes) through reservations ``r`` (one per key): the write,
        then BATCH_PUT_COMMIT asking for the next batch's. Keys whose write
        failed or whose reservation the master no longer holds are put from
        the start (without reservations); a key that exists keeps its value
        (OBJECT_ALREADY_EXISTS) and its reservation is given back."""
        self._learn_segments(r.segments)
        n = len(keys)
        placeholders = r.placeholders
        jobs = [(buf, rep, size) for buf, rep in zip(buffers, r.replicas, strict=True)]
        try:
            results = self._copy_batch(True, jobs, self.config.transfer_timeout_s, r.caps)
        except BaseException:
            self._unreserve(placeholders)
            raise
        again: list[int] = []  # key positions put from the start
        go: Sequence[int] = range(n)  # key positions committed
        if results.count(_COPIED) != n:
            again = [j for j, res_j in enumerate(results) if res_j is not _COPIED]
            for j in again:
                self._forget_segment(jobs[j][1].segment_id)
            log.info("batch put: %d writes into reservations failed (%s); putting them "
                     "from the start", len(again), results[again[0]][1])
            self._unreserve([placeholders[j] for j in again])
            go = [j for j in range(n) if results[j] is _COPIED]
        codes: list[ErrorCode] = [_OK] * n
        if go:
            every = len(go) == n
            names = keys if every else [keys[j] for j in go]
            held = placeholders if every else [placeholders[j] for j in go]
            try:
                end: BatchKeysReply = self._call(BatchPutCommit(
                    self.client_id, held, names, size, n))
            except MasterUnreachable as exc:
                if exc.code != ErrorCode.WRITE_OUTCOME_UNKNOWN:
                    raise
                # applied, maybe: a committed key's PUT_END answers OK, one not
                # applied OBJECT_NOT_FOUND (then put from the start)
                log.info("BATCH_PUT_COMMIT: %s; confirming with BATCH_PUT_END", exc)
                end = self._send_commit(BatchPutEnd(self.client_id, names))
            if isinstance(end, BatchReserveReply) and end.placeholders:
                # granted by the leader that answered
                self._keep_batch_reserved(end, size, self._term())
            if any(end.codes):
                give_back: list[str] = []
                for j, code in zip(go, end.codes, strict=True):
                    if not code:
                        continue
                    if code == ErrorCode.OBJECT_NOT_FOUND:  # expired or lost: put again
                        again.append(j)
                        continue
                    codes[j] = self._code(code)
                    if code == ErrorCode.OBJECT_ALREADY_EXISTS:  # still reserved: not ours
                        give_back.append(placeholders[j])
                if give_back:
                    self._unreserve(give_back)
        if again:
            again.sort()
            redo = self._batch_put_from([keys[j] for j in again], [buffers[j] for j in again],
                                        _config_for(config, again), False, False)
            for j, code in zip(again, redo, strict=True):
                codes[j] = code
        return codes

    # ------------------------------------------------------------------ get

    def _nearest_first(self, reps: list[ReplicaDescriptor]) -> list[ReplicaDescriptor]:
        """The complete replicas, nearest first (see :meth:`_rank`)."""
        if len(reps) == 1:
            return reps if reps[0].status is _COMPLETE else []
        out = [r for r in reps if r.status is _COMPLETE]
        out.sort(key=lambda r: self._rank(r.segment_id))
        return out

    def _locate(self, key: str) -> _ReadPlan:
        t0 = time.monotonic()  # the lease starts no earlier than our request
        res = self._call(GetReplicaList(key))
        self._learn_segments(res.segments)
        ttl_ms = res.lease_ttl_ms
        deadline = t0 + ttl_ms / 1000.0 if ttl_ms else float("inf")
        return _ReadPlan(res.size, res.checksum or None, deadline,
                         self._nearest_first(res.replicas), res.caps)

    def _read(self, key: str, plan: _ReadPlan, buffer: Any) -> int:
        """Read ``plan.size`` bytes into ``buffer``: nearest replica first, then the rest."""
        if not plan.replicas:
            raise error_for_code(ErrorCode.OBJECT_NOT_FOUND, f"{key!r} has no complete replica")
        errors: list[str] = []
        stale = False
        codes: list[ErrorCode] = []
        n = len(plan.replicas)
        for idx, r in enumerate(plan.replicas):
            remaining = plan.deadline - time.monotonic()
            if remaining <= 0:
                raise LeaseExpired(f"read lease of {key!r} expired before its data was read")
            # leave the replicas after this one a share of the lease: a dead
            # peer must not use up all of it
            budget = min(self.config.transfer_timeout_s, remaining / (n - idx))
            ((ok, err),) = self._copy_batch(False, [(buffer, r, plan.size)], budget, plan.caps,
                                            codes)
            if ok:
                if time.monotonic() > plan.deadline:
                    raise LeaseExpired(f"read of {key!r} ended after its lease; bytes discarded")
                self._verify(key, plan, buffer)
                return plan.size
            errors.append(f"{r.segment_id}: {err}")
            if codes[0] == ErrorCode.STALE_EPOCH:
                stale = True  # the node is fine: the grant is of an older master term
            else:
                self._forget_segment(r.segment_id)
        if time.monotonic() >= plan.deadline:
            raise LeaseExpired(f"read lease of {key!r} expired; replicas failed: "
                               + " | ".join(errors))
        if stale:
            raise StaleEpoch(f"get {key!r}: refused as a grant of an older master term: "
                             + " | ".join(errors))
        raise TransferFailed(f"get {key!r}: every replica failed: " + " | ".join(errors))

    def _read_inline_bytes(self, plan: _ReadPlan) -> bytes | None:
        """get()'s fastest path: one copy from a same-host segment into new bytes."""
        inline = self._inline
        if inline is None or not plan.replicas:
            return None
        r = plan.replicas[0]
        desc = self._known.get(r.segment_id)
        if not inline.eligible(desc, plan.size):
            return None
        try:
            assert desc is not None
            return inline.read_bytes(desc, r.offset, plan.size)
        except Exception as exc:
            log.debug("inline shm read of %s failed: %s", r.segment_id, exc)
            return None

    def _verify(self, key: str, plan: _ReadPlan, buffer: Any) -> None:
        if not isinstance(plan.checksum, str) or not self.config.verify_checksum:
            return
        view = host_view(buffer)
        if view is None:
            return  # GPU memory: verifying would cost a device->host copy
        ok = verify_checksum(plan.checksum, view[:plan.size])
        if ok is False:
            raise ChecksumMismatch(f"{key!r}: data does not match checksum {plan.checksum}")

    def get(self, key: str) -> bytes:
        """Return the value of ``key``.

        Raises ObjectNotFound, LeaseExpired, TransferFailed (every replica
        failed), ChecksumMismatch, MasterUnreachable, StoreTimeout, and
        StaleEpoch when the grants were refused as of an older master term
        twice (after a failover the first refusal re-asks the master).
        """
        self._check_open()
        self._valid_key(key)
        plan = self._locate(key)
        fast = self._read_inline_bytes(plan)
        if fast is not None:
            if time.monotonic() > plan.deadline:
                raise LeaseExpired(f"read of {key!r} ended after its lease; bytes discarded")
            self._verify(key, plan, fast)
            return fast
        out, target = alloc_bytes(plan.size)
        try:
            self._read(key, plan, target)
        except StaleEpoch as exc:  # a failover: the current leader grants afresh
            log.info("%s; asking the master again", exc)
            plan = self._locate(key)
            out, target = alloc_bytes(plan.size)
            self._read(key, plan, target)
        return out

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the value of ``key`` into ``buffer`` (host or GPU, raw or a
        registered BufferHandle); return the number of bytes read.

        Raises BufferTooSmall (nothing is read) and the errors of :meth:`get`.
        """
        self._check_open()
        self._valid_key(key)
        cap = buffer_nbytes(buffer)
        for retry in (False, True):
            plan = self._locate(key)
            if cap < plan.size:
                raise BufferTooSmall(f"{key!r} is {plan.size} bytes; buffer holds {cap}")
            try:
                return self._read(key, plan, buffer)
            except StaleEpoch as exc:  # a failover: the current leader grants afresh
                if retry:
                    raise
                log.info("%s; asking the master again", exc)
        raise AssertionError("unreachable")

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of many keys (None where missing or unreadable): one master RPC,
        one transfer batch."""
        outs: dict[int, bytes] = {}
        results = self._batch_read(keys, lambda i, size: _LAZY_BYTES, outs)
        return [outs.get(i) if r >= 0 else None for i, r in enumerate(results)]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Read many keys into their buffers; per key the bytes read or ``-code``
        (negative ErrorCode: OBJECT_NOT_FOUND, BUFFER_OVERFLOW, ...). One master
        RPC, one transfer batch."""
        self._check_open()
        if len(keys) != len(buffers):
            raise StoreError(f"{len(keys)} keys but {len(buffers)} buffers",
                             ErrorCode.INVALID_PARAMS)

        def target(i: int, size: int) -> Any:
            buf = buffers[i]
            if (buf.length if type(buf) is BufferHandle else buffer_nbytes(buf)) < size:
                return None
            return buf

        return self._batch_read(keys, target)

    def _batch_read(self, keys: Sequence[str], target: Callable[[int, int], Any],
                    outs: dict[int, bytes] | None = None,
                    parts: Sequence[Sequence[int]] | None = None,
                    on_part: Callable[[int, list[int]], None] | None = None,
                    reask_stale: bool = True, located: Located | None = None) -> list[int]:
        """Shared body of the batch reads. ``target(i, size)`` gives key i's
        buffer (None: too small) or ``_LAZY_BYTES``: produce a new ``bytes`` into
        ``outs[i]`` (inline shm reads copy straight into it). ``parts``: read
        these groups of key indices one after another (one transfer batch
        each), calling ``on_part(p, results of part p)`` after each. Keys whose
        grants were refused as of an older master term (STALE_EPOCH) are
        located and read once more (not with ``parts``: their results went out)."""
        self._check_open()
        n = len(keys)
        results: list[int] = [_UNREAD] * n
        if n == 0:
            return results
        valid: Sequence[int]
        if all(type(k) is str and 0 < len(k) <= MAX_KEY_LENGTH for k in keys):
            valid = range(n)  # the common case
        else:
            valid = []
            for i in range(n):
                key = keys[i]
                if type(key) is str and key and len(key) <= MAX_KEY_LENGTH:
                    valid.append(i)
                else:
                    results[i] = int(ErrorCode.INVALID_KEY)
        if not valid:
            return results
        if parts is not None:
            return self._read_parts(keys, target, outs, parts, on_part, results, valid,
                                    located)
        res, deadline = self._locate_many([keys[i] for i in valid] if len(valid) < n
                                          else list(keys))
        read: Iterable[int]  # the keys read
        if len(valid) == n and self._read_alike(res, deadline, target, results):
            read = range(n)
        else:
            plans: dict[int, _ReadPlan] = {}
            bufs: dict[int, Any] = {}
            self._plan_reads(res, deadline, enumerate(valid), target, plans, bufs, results)
            self._read_plans(keys, plans, bufs, outs, results, list(plans))
            read = plans
        stale = [i for i in read if results[i] == _STALE] if reask_stale else []
        if stale:  # a failover: the current leader grants afresh
            log.info("%d key(s) refused as of an older master term; asking again", len(stale))
            sub_outs: dict[int, bytes] | None = {} if outs is not None else None
            again = self._batch_read([keys[i] for i in stale],
                                     lambda j, size: target(stale[j], size), sub_outs,
                                     reask_stale=False)
            for j, i in enumerate(stale):
                results[i] = again[j]
                if outs is not None:
                    outs.pop(i, None)
                    if sub_outs is not None and j in sub_outs:
                        outs[i] = sub_outs[j]
        return results

    def _read_alike(self, res: Any, deadline: float, target: Callable[[int, int], Any],
                    results: list[int]) -> bool:
        """The common batch read: every key of ``res`` (a BATCH_GET_REPLICA_LIST
        reply for keys 0..n-1) found, one complete replica each, no checksums,
        every target a buffer: read as :meth:`_read_plans` reads one-replica
        plans (one transfer batch; a failed key is TRANSFER_FAIL, or _STALE when
        refused as of an older master term, or LEASE_EXPIRED once the lease
        ended), without a plan per key. False (nothing read, nothing set) when
        the reply is not of that shape."""
        replicas = res.replicas
        if any(res.codes) or res.checksums or set(map(len, replicas)) != _ONE_ONLY:
            return False
        reps = [r[0] for r in replicas]
        if any(r.status is not _COMPLETE for r in reps):
            return False
        sizes = res.sizes
        first = target(0, sizes[0])
        if first is None or first is _LAZY_BYTES:  # (get_batch's: every key alike)
            return False
        bufs = [first, *map(target, range(1, len(reps)), sizes[1:])]
        if any(b is None or b is _LAZY_BYTES for b in bufs):  # (no == on buffers)
            return False
        now = time.monotonic()
        if deadline <= now:
            results[:] = [int(ErrorCode.LEASE_EXPIRED)] * len(reps)
            return True
        codes: list[ErrorCode] = []
        timeout = max(0.001, min(self.config.transfer_timeout_s, deadline - now))
        copied = self._copy_batch(False, list(zip(bufs, reps, sizes, strict=True)), timeout,
                                  res.caps, codes)
        late = time.monotonic() > deadline  # the reads ended after the lease
        if not late and copied.count(_COPIED) == len(copied):
            results[:] = sizes
            return True
        expired = int(ErrorCode.LEASE_EXPIRED)
        ended = deadline <= time.monotonic()  # no retry of a failed read then
        for i, (ok, _err) in enumerate(copied):
            if ok:
                results[i] = expired if late else sizes[i]
            elif codes[i] == ErrorCode.STALE_EPOCH:  # the node is fine; the grant is older
                results[i] = expired if ended else _STALE
            else:
                self._forget_segment(reps[i].segment_id)
                results[i] = expired if ended else int(ErrorCode.TRANSFER_FAIL)
        return True

    def _locator(self) -> ThreadPoolExecutor:
        """The threads that send pipelined reads' second locate RPC (kept, so
        each keeps its RPC socket: a thread per read paid a start-up and a
        socket each time)."""
        with self._rpc_lock:
            if self._closed:  # shut down by close(): the typed error, not the pool's
                raise StoreError("client is closed", ErrorCode.CLOSED)
            if self._locate_pool is None:
                self._locate_pool = ThreadPoolExecutor(2, thread_name_prefix="kvpool-locate")
            return self._locate_pool

    def _locate_many(self, keys: list[str]) -> tuple[Any, float]:
        """One BATCH_GET_REPLICA_LIST: the reply and its read lease's deadline."""
        t0 = time.monotonic()
        res = self._call(BatchGetReplicaList(keys))
        self._learn_segments(res.segments)
        ttl_ms = res.lease_ttl_ms
        return res, (t0 + ttl_ms / 1000.0 if ttl_ms else float("inf"))

    def _plan_reads(self, res: Any, deadline: float, pairs: Iterable[tuple[int, int]],
                    target: Callable[[int, int], Any], plans: dict[int, _ReadPlan],
                    bufs: dict[int, Any], results: list[int]) -> None:
        """For each ``(reply position, key index)`` of ``pairs``: a read plan and
        the key's buffer, or its result code (not found, buffer too small...)."""
        codes, sizes, replicas, checksums, caps = (res.codes, res.sizes, res.replicas,
                                                   res.checksums, res.caps)
        nearest = self._nearest_first
        for pos, i in pairs:
            code = codes[pos]
            if code:
                results[i] = int(self._code(code))
                continue
            reps = replicas[pos]
            if len(reps) != 1 or reps[0].status is not _COMPLETE:  # else: nearest() as is
                reps = nearest(reps)
                if not reps:
                    results[i] = int(ErrorCode.OBJECT_NOT_FOUND)
                    continue
            plan = _ReadPlan(sizes[pos], checksums[pos] if checksums else None, deadline,
                             reps, caps)
            buf = target(i, plan.size)
            if buf is None:
                results[i] = int(ErrorCode.BUFFER_OVERFLOW)
                continue
            plans[i] = plan
            bufs[i] = buf

    def _read_parts(self, keys: Sequence[str], target: Callable[[int, int], Any],
                    outs: dict[int, bytes] | None, parts: Sequence[Sequence[int]],
                    on_part: Callable[[int, list[int]], None] | None, results: list[int],
                    valid: Sequence[int], located: Located | None = None) -> list[int]:
        """The ``parts`` form of :meth:`_batch_read`. A pipelined consumer waits
        for part 0 first, so its keys are located first, by a small RPC; the
        other keys by a second RPC sent from a helper thread as soon as the
        first is answered, so the master answers it while part 0 moves. Keys
        are planned part by part (their buffers asked for when their part is
        read). A failed second RPC fails the later parts' keys with its code.
        A usable ``located`` (this host, enough lease left) that answers every
        key of part 0 replaces part 0's RPC."""
        ok = set(valid)
        first = list(dict.fromkeys(i for i in parts[0] if i in ok))
        in_first = set(first)
        rest = list(dict.fromkeys(i for part in parts[1:] for i in part
                                  if i in ok and i not in in_first))
        placed = in_first.union(rest)
        rest += [i for i in valid if i not in placed]  # located (codes set), not read
        where: dict[int, tuple[int, int]] = {}  # key index -> (reply 0 or 1, position)
        replies: list[tuple[Any, float] | None] = [None, None]
        helper: Future[tuple[Any, float]] | None = None  # the second RPC
        if not SPLIT_PART_LOCATE:
            first, rest = first + rest, []
        for pos, i in enumerate(first):
            where[i] = (0, pos)
        for pos, i in enumerate(rest):
            where[i] = (1, pos)
        if first and located is not None and located.usable(
                min(LOCATED_MIN_LEFT_S, located.reply.lease_ttl_ms / 2000)):
            at = located.positions()
            if all(keys[i] in at for i in first):
                self._learn_segments(located.reply.segments)
                replies[0] = (located.reply, located.deadline)
                for i in first:
                    where[i] = (0, at[keys[i]])
                first = []  # located: no RPC for them
        if first:
            replies[0] = self._locate_many([keys[i] for i in first])
        if rest:
            helper = self._locator().submit(self._locate_many, [keys[i] for i in rest])
        plans: dict[int, _ReadPlan] = {}
        bufs: dict[int, Any] = {}
        rest_code = 0
        for p, part in enumerate(parts):
            if p >= 1 and helper is not None:
                try:
                    replies[1] = helper.result()
                except KVPoolError as got:
                    rest_code = int(self._code(got.code))
                    log.warning("locating %d key(s) for later parts failed: %s", len(rest), got)
                helper = None
            todo = [i for i in part if i in where and results[i] == _UNREAD
                    and (p == 0 or i not in in_first)]
            for r in (0, 1):
                mine = [(where[i][1], i) for i in todo if where[i][0] == r]
                reply = replies[r]
                if not mine:
                    continue
                if reply is None:  # the second RPC failed
                    for _pos, i in mine:
                        results[i] = rest_code or int(ErrorCode.INTERNAL_ERROR)
                    continue
                self._plan_reads(reply[0], reply[1], mine, target, plans, bufs, results)
            self._read_plans(keys, plans, bufs, outs, results, [i for i in todo if i in plans])
            if on_part is not None:
                on_part(p, [results[i] for i in part])
        if helper is not None:  # one part only: the rest are just located
            try:
                rest_reply = helper.result()
            except KVPoolError:
                pass
            else:
                self._plan_reads(rest_reply[0], rest_reply[1], [(where[i][1], i) for i in rest],
                                 target, plans, bufs, results)
        for i in rest:
            if i in plans and i not in placed:
                results[i] = _UNREAD  # located, not read: as before any read
        return results

    def _read_plans(self, keys: Sequence[str], plans: dict[int, _ReadPlan],
                    bufs: dict[int, Any], outs: dict[int, bytes] | None, results: list[int],
                    pending: list[int]) -> None:
        """Read the ``pending`` planned keys into ``bufs`` (results set per key)."""
        # Round k reads every pending key from its k-th nearest replica: the
        # common case is one round, i.e. one transfer batch for the whole call.
        # Every plan comes from one master reply: one lease deadline, one caps list.
        if not pending:
            return
        first = plans[pending[0]]
        deadline, caps = first.deadline, first.caps
        attempt = 0
        stale: set[int] = set()  # keys refused as of an older master term
        codes: list[ErrorCode] = []
        while pending:
            now = time.monotonic()
            jobs: list[tuple[Any, ReplicaDescriptor, int]] = []
            owners: list[int] = []
            if deadline <= now:  # one lease deadline for every plan (see above)
                for i in pending:
                    results[i] = int(ErrorCode.LEASE_EXPIRED)
                break
            left = 1  # the most replicas a key has left to try, this one included
            checked = False  # some key has a checksum to verify
            for i in pending:
                plan = plans[i]
                reps = plan.replicas
                n_reps = len(reps)
                if attempt >= n_reps:
                    results[i] = _STALE if i in stale else int(ErrorCode.TRANSFER_FAIL)
                    continue
                if n_reps - attempt > left:
                    left = n_reps - attempt
                if plan.checksum is not None:
                    checked = True
                r = reps[attempt]
                buf = bufs[i]
                if buf is _LAZY_BYTES:
                    assert outs is not None
                    fast = self._read_inline_bytes(_ReadPlan(plan.size, None, plan.deadline,
                                                             [r], caps))
                    if fast is not None:
                        outs[i] = fast
                        bufs[i] = fast
                        results[i] = self._finish_read(keys[i], plan, fast)
                        continue
                    out, buf = alloc_bytes(plan.size)
                    bufs[i] = buf
                    outs[i] = out
                jobs.append((buf, r, plan.size))
                owners.append(i)
            if not jobs:
                break
            # every key of the call shares one lease deadline (one master reply)
            timeout = max(0.001, min(self.config.transfer_timeout_s, (deadline - now) / left))
            copied = self._copy_batch(False, jobs, timeout, caps, codes)
            pending = []
            late = time.monotonic() > deadline  # the reads ended after the lease
            verify = self.config.verify_checksum
            if not late and not (verify and checked) and copied.count(_COPIED) == len(copied):
                for i in owners:  # every read copied, nothing to verify (the common case)
                    results[i] = plans[i].size
                break
            for (buf, r, _s), i, (ok, _err), code in zip(jobs, owners, copied, codes,
                                                         strict=True):
                if not ok:
                    if code == ErrorCode.STALE_EPOCH:
                        stale.add(i)  # the node is fine; the grant is of an older term
                    else:
                        self._forget_segment(r.segment_id)
                    pending.append(i)
                elif late:
                    results[i] = int(ErrorCode.LEASE_EXPIRED)
                elif verify and plans[i].checksum is not None:
                    results[i] = self._finish_read(keys[i], plans[i], buf)
                else:
                    results[i] = plans[i].size
            attempt += 1

    def _finish_read(self, key: str, plan: _ReadPlan, buf: Any) -> int:
        """Result code of a completed read: size, or LEASE_EXPIRED / CHECKSUM_MISMATCH."""
        if time.monotonic() > plan.deadline:
            return int(ErrorCode.LEASE_EXPIRED)
        try:
            self._verify(key, plan, buf)
        except ChecksumMismatch:
            return int(ErrorCode.CHECKSUM_MISMATCH)
        return plan.size

    # ------------------------------------------------------------------ buffers

    def register_buffer(self, buffer: Any, device: str | None = None) -> Any:
        """Register host or GPU memory for repeated zero-copy put_from/get_into;
        returns a BufferHandle usable wherever a buffer is taken. ``device``
        ("cpu"/"cuda") classifies a raw ``(address, length)``."""
        self._check_open()
        try:
            if device is not None:
                handle = self._engine.register_buffer(buffer, device=device)
            else:
                handle = self._engine.register_buffer(buffer)
        except KVPoolError as exc:
            raise error_for_code(exc.code, str(exc)) from exc
        if handle.is_gpu and not self._gpu_segments_learned:
            self._gpu_segments_learned = True
            self._learn_memory_segments()
        return handle

    def _learn_memory_segments(self) -> None:
        """Learn every memory segment now (one LIST_SEGMENTS): with a GPU buffer
        registered, the engine then page-locks their mappings in the background
        instead of inside the first put or get (tens of ms per segment)."""
        try:
            segs = self.list_segments()
        except StoreError as exc:
            log.debug("list_segments for GPU warm-up: %s", exc)
            return
        self._learn_segments({s.descriptor.segment_id: s.descriptor for s in segs
                              if s.descriptor.kind == SegmentKind.MEMORY})

    def unregister_buffer(self, handle: Any) -> None:
        """Release a handle from :meth:`register_buffer`."""
        self._check_open()
        try:
            self._engine.unregister_buffer(handle)
        except KVPoolError as exc:
            raise error_for_code(exc.code, str(exc)) from exc

    # ------------------------------------------------------------------ queries

    def exists(self, key: str) -> bool:
        """True when ``key`` has a complete replica (grants a read lease)."""
        self._valid_key(key)
        try:
            return self._call(Exist(key)).exists
        except ObjectNotFound:
            return False

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` for many keys in one RPC, in input order ([] for [])."""
        self._check_open()
        if not keys:
            return []
        for k in keys:
            self._valid_key(k)
        res = self._call(BatchExist(list(keys)))
        return [not code and found for code, found in zip(res.codes, res.exists, strict=True)]

    def get_size(self, key: str) -> int:
        """Size in bytes of ``key``'s value (ObjectNotFound if missing)."""
        self._valid_key(key)
        return self._call(GetSize(key)).size

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``. A leased object raises StoreError(OBJECT_HAS_LEASE)
        unless ``force``; a missing one raises ObjectNotFound."""
        self._valid_key(key)
        self._call(Remove(key, bool(force)))

    def remove_all(self, force: bool = False) -> int:
        """Remove every (unleased, or all with ``force``) object; return the count."""
        return self._call(RemoveAll(bool(force))).removed

    def replica_segments(self, key: str) -> list[str]:
        """Segment ids holding a complete replica of ``key``, nearest first
        (grants a read lease, like exists)."""
        self._valid_key(key)
        return [r.segment_id for r in self._locate(key).replicas]

    def stats(self) -> StatsReply:
        """The master's STATS (uptime, objects, bytes used/capacity, ...)."""
        return self._call(Stats())

    def list_segments(self) -> list[SegmentInfo]:
        """The master's LIST_SEGMENTS: every mounted segment with used/capacity."""
        return self._call(ListSegments()).segments

    def is_gpu(self, buffer: Any) -> bool:
        """Whether ``buffer`` is device memory (checksums skip those)."""
        return is_gpu_buffer(buffer)

    def batch_get_into_parts(self, keys: Sequence[str], buffers: Sequence[Any],
                             parts: Sequence[Sequence[int]],
                             on_part: Callable[[int, list[int]], None],
                             located: Located | None = None) -> list[int]:
        """:meth:`batch_get_into` for pipelined consumers: the keys of ``parts``
        (lists of indices into ``keys``) are read part after part, one transfer
        batch each, and ``on_part(p, results)`` runs after part ``p`` (results
        as in batch_get_into, in the part's order) so the caller can use it
        while later parts still move. Two master RPCs locate the keys: one for
        part 0's, answered first, and one for the others, sent at once from a
        helper thread so that it is answered while part 0 moves (the caller
        waits only for part 0's lookup and copies). Indices in no part are
        located, not read. Each RPC's read lease covers its keys: parts still
        unread when it ends fail with LEASE_EXPIRED; a failed second RPC fails
        the later parts' keys with its code (part 0's results stand).
        ``located`` (from :meth:`locate_for_reads`, here or in another process of
        this host) that answers every key of part 0, with at least
        ``LOCATED_MIN_LEFT_S`` (or half) of its lease left, is used instead of part 0's
        RPC: the first transfer starts at once. Else it is ignored."""
        self._check_open()
        if len(keys) != len(buffers):
            raise StoreError(f"{len(keys)} keys but {len(buffers)} buffers",
                             ErrorCode.INVALID_PARAMS)

        def target(i: int, size: int) -> Any:
            return buffers[i] if buffer_nbytes(buffers[i]) >= size else None

        return self._batch_read(keys, target, None, parts, on_part, located=located)

    # ------------------------------------------------------------------ locations

    def locate_for_reads(self, keys: Sequence[str]) -> Located:
        """One BATCH_GET_REPLICA_LIST of ``keys`` (grants read leases, like
        :meth:`batch_exists`), kept whole: :meth:`replica_locations` says where
        each key is, and :meth:`batch_get_into_parts` (in this process or
        another of this host) can read part 0 from it without asking again."""
        self._check_open()
        for k in keys:
            self._valid_key(k)
        if not keys:
            return Located([], BatchGetReplicaListReply([], [], [], 0), float("inf"), boot_id())
        res, deadline = self._locate_many(list(keys))
        return Located(list(keys), res, deadline, boot_id())

    def replica_locations(self, located: Located) -> list[list[ReplicaLocation] | None]:
        """Per key of ``located``: its complete replicas, nearest first (the
        order reads try them), or None where it is missing."""
        res = located.reply
        out: list[list[ReplicaLocation] | None] = []
        for pos, code in enumerate(res.codes):
            if code != ErrorCode.OK:
                out.append(None)
                continue
            size = res.sizes[pos]
            locs = []
            for r in self._nearest_first(res.replicas[pos]):
                desc = self._known.get(r.segment_id)
                locs.append(ReplicaLocation(
                    r.segment_id, size,
                    desc.host_id if desc is not None else "",
                    desc.kind if desc is not None else SegmentKind.MEMORY,
                    desc is not None and desc.host_id == self.host_id))
            out.append(locs or None)
        return out

    def batch_replica_locations(self, keys: Sequence[str]) -> list[list[ReplicaLocation] | None]:
        """Where each key's complete replicas are, nearest first (the order reads
        try them); None for a missing key. One BATCH_GET_REPLICA_LIST RPC; grants
        read leases, like :meth:`batch_exists`. Lets a caller estimate a read's
        time from what it measured per tier and peer before reading."""
        return self.replica_locations(self.locate_for_reads(keys))

    # ------------------------------------------------------------------ multi-part and ranged I/O
    # The primitives under Mooncake's multi-buffer, range and session calls
    # (store/mooncake_*.py): each call is at most one master RPC and one
    # transfer batch. A write reserves space (BATCH_PUT_START), copies byte
    # ranges of caller buffers into every replica, then commits (BATCH_PUT_END)
    # or aborts (BATCH_PUT_REVOKE); a read locates objects once
    # (BATCH_GET_REPLICA_LIST, read lease) and copies byte ranges out.

    def batch_put_reserve(self, keys: Sequence[str], sizes: Sequence[int],
                          config: ReplicateConfig | None = None,
                          checksums: Sequence[Checksum] | None = None,
                          upsert: bool = False) -> list[Reservation]:
        """Reserve ``sizes[i]`` bytes for ``keys[i]`` on every replica, moving no data.

        Per key a :class:`Reservation`: code OK with its replicas (and the
        capability tokens they point at), or why not (INVALID_KEY,
        INVALID_PARAMS for a size <= 0, OBJECT_ALREADY_EXISTS,
        NO_AVAILABLE_HANDLE...). A reserved key must be committed with
        :meth:`batch_put_commit` or aborted with :meth:`batch_put_abort` (the
        master discards it after ``put_start_discard_timeout_s`` otherwise).
        ``checksums[i]`` (a :func:`parts_checksum` string) is recorded with the
        object and verified by readers. One master RPC. ``upsert``: an existing
        key is replaced (BATCH_UPSERT_START): its object stays readable until
        the commit swaps the new one in.
        """
        self._check_open()
        if len(keys) != len(sizes) or (checksums is not None and len(checksums) != len(keys)):
            raise StoreError(f"{len(keys)} keys but {len(sizes)} sizes", ErrorCode.INVALID_PARAMS)
        out = [Reservation(ErrorCode.OK, int(size), [], _NO_CAPS) for size in sizes]
        groups = self._groups(config, len(keys))
        put_keys: list[str] = []
        put_sizes: list[int] = []
        sums: list[Checksum] = []
        idx: list[int] = []
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if type(key) is not str or not key or len(key) > MAX_KEY_LENGTH:
                out[i].code = ErrorCode.INVALID_KEY
                continue
            if key in seen:
                out[i].code = ErrorCode.OBJECT_ALREADY_EXISTS
                continue
            if out[i].size <= 0:
                out[i].code = ErrorCode.INVALID_PARAMS
                continue
            seen.add(key)
            put_keys.append(key)
            put_sizes.append(out[i].size)
            sums.append(checksums[i] if checksums is not None else None)
            idx.append(i)
        if not idx:
            return out
        start = BatchUpsertStart if upsert else BatchPutStart
        res = self._call(start(self.client_id, put_keys, put_sizes, self._put_options(config),
                               sums if any(c is not None for c in sums) else None,
                               None if groups is None else [groups[i] for i in idx]))
        self._learn_segments(res.segments)
        empty: list[str] = []
        for pos, (code, reps) in enumerate(zip(res.codes, res.replicas, strict=True)):
            i = idx[pos]
            if code:
                out[i].code = self._code(code)
                continue
            out[i].replicas = list(reps)
            out[i].caps = res.caps
            if not reps:  # nothing to write to: give the reservation back
                out[i].code = ErrorCode.NO_AVAILABLE_HANDLE
                empty.append(put_keys[pos])
        self._revoke(empty)
        return out

    def write_ranges(self, writes: Sequence[RangeWrite],
                     timeout_s: float | None = None) -> list[tuple[bool, str]]:
        """Copy each write's buffer into ``[offset, offset + length)`` of every one
        of its replicas: one transfer batch, no RPC. Per write ``(ok, error)``;
        a range outside the reserved object fails without moving bytes. Raises
        StoreTimeout when the batch overruns ``timeout_s`` (default
        ``transfer_timeout_s``)."""
        self._check_open()
        results: list[tuple[bool, str]] = [_COPIED] * len(writes)
        jobs: list[tuple[Any, ReplicaDescriptor, int]] = []
        owner: list[int] = []
        caps = _CapsMerge()
        for w, wr in enumerate(writes):
            n = wr.nbytes()
            for r in wr.replicas:
                if wr.offset < 0 or n < 0 or wr.offset + n > r.length:
                    results[w] = (False, f"range [{wr.offset}, {wr.offset + n}) is outside "
                                         f"the {r.length}-byte object")
                    break
            else:
                if n == 0:
                    continue
                base = caps.base(wr.caps)
                for r in wr.replicas:
                    jobs.append((wr.buffer, _sub_replica(r, wr.offset, n, base), n))
                    owner.append(w)
        if not jobs:
            return results
        copied = self._copy_batch(True, jobs, timeout_s or self.config.transfer_timeout_s,
                                  caps.caps)
        for (_b, r, _n), w, (ok, err) in zip(jobs, owner, copied, strict=True):
            if not ok:
                self._forget_segment(r.segment_id)
                if results[w][0]:
                    results[w] = (False, f"{r.segment_id}: {err}")
        return results

    def batch_put_commit(self, keys: Sequence[str]) -> list[ErrorCode]:
        """Make reserved keys readable (BATCH_PUT_END); per key OK or why not."""
        self._check_open()
        if not keys:
            return []
        end = self._call(BatchPutEnd(self.client_id, list(keys)))
        return [self._code(code) for code in end.codes]

    def batch_put_abort(self, keys: Sequence[str]) -> None:
        """Give reserved keys back (BATCH_PUT_REVOKE); failures are logged."""
        self._revoke(list(keys))

    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                        config: ReplicateConfig | None = None,
                        upsert: bool = False) -> list[ErrorCode]:
        """Store each key's value as the concatenation of its parts (host or GPU
        buffers, raw or registered handles): one BATCH_PUT_START, one transfer
        batch writing every part into every replica, one BATCH_PUT_END. Per key
        the :meth:`batch_put_from` codes. ``upsert``: insert or replace
        (:meth:`batch_put_reserve`)."""
        self._check_open()
        if len(keys) != len(parts):
            raise StoreError(f"{len(keys)} keys but {len(parts)} part lists",
                             ErrorCode.INVALID_PARAMS)
        sizes = [sum(buffer_nbytes(p) for p in ps) for ps in parts]
        checksums: list[Checksum] | None = None
        if self._checksum_algo is not None:
            checksums = [parts_checksum(self._checksum_algo, ps) for ps in parts]
        held = self.batch_put_reserve(keys, sizes, config, checksums, upsert)
        term = self._term()
        codes = [rv.code for rv in held]
        reserved = [i for i, c in enumerate(codes) if c == ErrorCode.OK]
        give_back: Callable[[], None] | None = None
        try:
            writes, owner, give_back = self._stage_gpu_writes(held, parts)
            staged = set(owner)
            for i, (rv, ps) in enumerate(zip(held, parts, strict=True)):
                if rv.code != ErrorCode.OK or i in staged:
                    continue
                off = 0
                for p in ps:
                    n = buffer_nbytes(p)
                    if n:
                        writes.append(RangeWrite(p, rv.replicas, off, n, rv.caps))
                        owner.append(i)
                    off += n
            writes, owner = self._gather_parts(held, parts, writes, owner)
            done = self.write_ranges(writes)
        except BaseException:
            self.batch_put_abort([keys[i] for i in reserved])
            raise
        finally:
            if give_back is not None:
                give_back()
        for (ok, _err), i in zip(done, owner, strict=True):
            if not ok:
                codes[i] = ErrorCode.TRANSFER_FAIL
        self.batch_put_abort([keys[i] for i in reserved if codes[i] != ErrorCode.OK])
        good = [i for i in reserved if codes[i] == ErrorCode.OK]
        if good:
            ends = self._commit_batch(
                [keys[i] for i in good], term, upsert,
                lambda lost: self.batch_put_parts(
                    [keys[good[p]] for p in lost], [parts[good[p]] for p in lost],
                    _config_for(config, [good[p] for p in lost]), upsert))
            for i, code in zip(good, ends, strict=True):
                codes[i] = code
        return codes

    def _device_staging(self, device: int, nbytes: int
                        ) -> tuple[DeviceStaging, tuple[int, int]] | None:
        """A device staging buffer of ``nbytes`` (kvpool.store._gpustage), or None."""
        with self._staging_lock:
            staging = self._owned.staging
            if staging is None:
                rt, _ = cuda_runtime()
                if rt is None:
                    return None
                staging = self._owned.staging = DeviceStaging(rt)
        buf = staging.take(device, nbytes)
        return None if buf is None else (staging, buf)

    @staticmethod
    def _gpu_keys(sizes: Sequence[int], parts: Sequence[Sequence[Any]], want: Sequence[int]
                  ) -> tuple[int, int, list[tuple[int, list[tuple[int, int]]]]]:
        """Of the keys ``want``, those made of several GPU parts of one device
        that fit one staging buffer together: ``(device, total bytes, [(key,
        [(address, bytes)])])``."""
        device, total = -1, 0
        out: list[tuple[int, list[tuple[int, int]]]] = []
        for i in want:
            if len(parts[i]) < 2 or total + sizes[i] > STAGING_MAX_BYTES:
                continue
            found = gpu_regions(parts[i])
            if found is None or (device >= 0 and found[0] != device):
                continue
            device = found[0]
            out.append((i, found[1]))
            total += sizes[i]
        return device, total, out

    def _stage_gpu_writes(self, held: Sequence[Reservation], parts: Sequence[Sequence[Any]]
                          ) -> tuple[list[RangeWrite], list[int], Callable[[], None] | None]:
        """Keys made of several GPU parts are gathered on the GPU into one
        staging buffer (a few 2-D copies for the whole call) and written as one
        range each. Returns those writes, their keys and what gives the
        staging buffer back once they are done (None: nothing staged)."""
        device, total, keys = self._gpu_keys(
            [rv.size for rv in held], parts,
            [i for i, rv in enumerate(held) if rv.code == ErrorCode.OK])
        taken = self._device_staging(device, total) if keys else None
        if taken is None:
            return [], [], None
        staging, buf = taken
        at = buf[0]
        per_key: list[list[tuple[int, int, int]]] = []
        staged: list[RangeWrite] = []
        for i, regions in keys:
            rv = held[i]
            copies, off = [], at
            for ptr, n in regions:
                copies.append((off, ptr, n))
                off += n
            per_key.append(copies)
            staged.append(RangeWrite(BufferHandle(ptr=at, length=rv.size, device="cuda",
                                                  device_index=device),
                                     rv.replicas, 0, rv.size, rv.caps))
            at += rv.size
        try:
            run_copies(staging.rt, plan_copies(per_key), device)
        except Exception as exc:  # write part by part instead
            log.warning("GPU gather of %d keys failed: %s", len(keys), exc)
            staging.give(device, buf)
            return [], [], None
        return staged, [i for i, _ in keys], functools.partial(staging.give, device, buf)

    def _inline_region(self, r: ReplicaDescriptor, size: int) -> Any:
        """The same-host shm bytes of replica ``r`` as a numpy view, when the
        inline path would copy them (else None)."""
        inline = self._inline
        if inline is None:
            return None
        region = inline.target(self._known.get(r.segment_id), size)
        if region is None or r.offset < 0 or r.offset + size > region.size:
            return None
        return region[r.offset:r.offset + size]

    def _gather_parts(self, held: Sequence[Reservation], parts: Sequence[Sequence[Any]],
                      writes: list[RangeWrite], owner: list[int]
                      ) -> tuple[list[RangeWrite], list[int]]:
        """Small objects (< 4 MiB) made of several host parts become one copy
        per replica instead of one request per part: same-host shm replicas
        get ``np.concatenate`` straight into the segment; any other replica one
        write of the parts gathered into a staging buffer (a memcpy costs far
        less than a request each over tcp). Returns the writes still to do."""
        handled: set[int] = set()
        staged: list[RangeWrite] = []
        staged_owner: list[int] = []
        for i, rv in enumerate(held):
            if rv.code != ErrorCode.OK or not 0 < rv.size < _GATHER_MAX or len(parts[i]) < 2:
                continue
            arrs = _host_arrays(parts[i])
            if arrs is None:
                continue
            dests = [self._inline_region(r, rv.size) for r in rv.replicas]
            remote = [r for r, d in zip(rv.replicas, dests, strict=True) if d is None]
            for d in dests:
                if d is not None:
                    np.concatenate(arrs, out=d)  # type: ignore[arg-type]
            if remote:
                staged.append(RangeWrite(np.concatenate(arrs), remote, 0,  # type: ignore[arg-type]
                                         rv.size, rv.caps))
                staged_owner.append(i)
            handled.add(i)
        if not handled:
            return writes, owner
        keep = [j for j, i in enumerate(owner) if i not in handled]
        return ([writes[j] for j in keep] + staged,
                [owner[j] for j in keep] + staged_owner)

    def batch_locate(self, keys: Sequence[str]) -> list[Location]:
        """Where each key can be read from (one BATCH_GET_REPLICA_LIST; grants a
        read lease per found key): a :class:`Location` with code OK, the size,
        checksum, lease deadline and complete replicas nearest first, or the
        code why not (INVALID_KEY, OBJECT_NOT_FOUND...)."""
        self._check_open()
        out = [Location(ErrorCode.INTERNAL_ERROR) for _ in keys]
        valid: list[int] = []
        for i, key in enumerate(keys):
            if type(key) is str and key and len(key) <= MAX_KEY_LENGTH:
                valid.append(i)
            else:
                out[i] = Location(ErrorCode.INVALID_KEY)
        if not valid:
            return out
        t0 = time.monotonic()  # the lease starts no earlier than our request
        res = self._call(BatchGetReplicaList([keys[i] for i in valid]))
        self._learn_segments(res.segments)
        ttl_ms = res.lease_ttl_ms
        deadline = t0 + ttl_ms / 1000.0 if ttl_ms else float("inf")
        for pos, i in enumerate(valid):
            code = res.codes[pos]
            if code:
                out[i] = Location(self._code(code))
                continue
            reps = self._nearest_first(res.replicas[pos])
            if not reps:
                out[i] = Location(ErrorCode.OBJECT_NOT_FOUND)
                continue
            checksum = res.checksums[pos] if res.checksums else None
            out[i] = Location(ErrorCode.OK, res.sizes[pos],
                              checksum if isinstance(checksum, str) else None, deadline, reps,
                              res.caps)
        return out

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[int]:
        """Copy ``[src_offset, src_offset + length)`` of each read's located object
        into the start of its buffer; no RPC. Round k reads every pending range
        from its object's k-th nearest replica (one transfer batch per round;
        usually one round). Per read the bytes read, or a negative code:
        INVALID_PARAMS (range outside the object or larger than the buffer),
        LEASE_EXPIRED (the location's read lease ended; bytes discarded),
        TRANSFER_FAIL (every replica failed), STALE_EPOCH (refused as a grant
        of an older master term: locate again), the location's own code."""
        self._check_open()
        results = [int(ErrorCode.INTERNAL_ERROR)] * len(reads)
        pending: list[int] = []
        stale: set[int] = set()  # reads refused as of an older master term
        codes: list[ErrorCode] = []
        for j, rd in enumerate(reads):
            loc = rd.location
            if loc.code != ErrorCode.OK:
                results[j] = int(loc.code)
            elif rd.src_offset < 0 or rd.length < 0 or rd.src_offset + rd.length > loc.size \
                    or buffer_nbytes(rd.buffer) < rd.length:
                results[j] = int(ErrorCode.INVALID_PARAMS)
            elif rd.length == 0:
                results[j] = 0
            else:
                pending.append(j)
        attempt = 0
        while pending:
            now = time.monotonic()
            jobs: list[tuple[Any, ReplicaDescriptor, int]] = []
            owners: list[int] = []
            caps = _CapsMerge()
            for j in pending:
                rd = reads[j]
                if rd.location.deadline <= now:
                    results[j] = int(ErrorCode.LEASE_EXPIRED)
                elif attempt >= len(rd.location.replicas):
                    results[j] = _STALE if j in stale else int(ErrorCode.TRANSFER_FAIL)
                else:
                    r = rd.location.replicas[attempt]
                    jobs.append((rd.buffer, _sub_replica(r, rd.src_offset, rd.length,
                                                         caps.base(rd.location.caps)),
                                 rd.length))
                    owners.append(j)
            if not jobs:
                break
            lease_left = min(reads[j].location.deadline for j in owners) - now
            left = max(len(reads[j].location.replicas) - attempt for j in owners)
            timeout = max(0.001, min(self.config.transfer_timeout_s, lease_left / left))
            copied = self._copy_batch(False, jobs, timeout, caps.caps, codes)
            pending = []
            end = time.monotonic()
            for (_b, r, n), j, (ok, _err), code in zip(jobs, owners, copied, codes,
                                                       strict=True):
                if not ok:
                    if code == ErrorCode.STALE_EPOCH:
                        stale.add(j)
                    else:
                        self._forget_segment(r.segment_id)
                    pending.append(j)
                elif end > reads[j].location.deadline:
                    results[j] = int(ErrorCode.LEASE_EXPIRED)
                else:
                    results[j] = n
            attempt += 1
        return results

    def batch_get_parts(self, keys: Sequence[str],
                        parts: Sequence[Sequence[Any]]) -> list[int]:
        """Read each key's value scattered over its parts in order (the first
        part gets the first bytes): one master RPC, one transfer batch. Per key
        the object size, or a negative code: BUFFER_OVERFLOW (the parts hold
        fewer bytes than the object; nothing is read), CHECKSUM_MISMATCH, and
        the codes of :meth:`read_ranges`."""
        self._check_open()
        if len(keys) != len(parts):
            raise StoreError(f"{len(keys)} keys but {len(parts)} part lists",
                             ErrorCode.INVALID_PARAMS)
        locs = self.batch_locate(keys) if keys else []
        results = [int(loc.code) for loc in locs]
        reads: list[RangeRead] = []
        owner: list[int] = []
        staged: list[tuple[int, np.ndarray, list[Any]]] = []
        maybe_gpu: list[int] = []

        def part_by_part(i: int) -> None:
            loc, off = locs[i], 0
            for p in parts[i]:
                n = min(buffer_nbytes(p), loc.size - off)
                if n <= 0:
                    break
                reads.append(RangeRead(loc, p, off, n))
                owner.append(i)
                off += n

        for i, (loc, ps) in enumerate(zip(locs, parts, strict=True)):
            if loc.code != ErrorCode.OK:
                continue
            if sum(buffer_nbytes(p) for p in ps) < loc.size:
                results[i] = int(ErrorCode.BUFFER_OVERFLOW)
                continue
            results[i] = loc.size
            done = self._scatter_inline(loc, ps)
            if done is not None:
                results[i] = done
                continue
            if 0 < loc.size < _GATHER_MAX and len(ps) > 1:
                arrs = _host_arrays(ps, writeable=True)
                if arrs is not None:
                    # one request into a staging buffer, scattered after the batch
                    tmp = np.empty(loc.size, dtype=np.uint8)
                    staged.append((i, tmp, arrs))
                    reads.append(RangeRead(loc, tmp, 0, loc.size))
                    owner.append(i)
                    continue
            if len(ps) > 1 and loc.size > 0:
                maybe_gpu.append(i)
                continue
            part_by_part(i)
        # several GPU parts per key: one read per key into a device staging
        # buffer, scattered on the GPU after the batch (kvpool.store._gpustage)
        device, total, gpu = self._gpu_keys([loc.size for loc in locs], parts, maybe_gpu)
        taken = self._device_staging(device, total) if gpu else None
        on_gpu = {i for i, _ in gpu} if taken is not None else set()
        for i in maybe_gpu:
            if i not in on_gpu:
                part_by_part(i)
        where: dict[int, int] = {}
        if taken is not None:
            at = taken[1][0]
            for i, _ in gpu:
                where[i] = at
                reads.append(RangeRead(locs[i], BufferHandle(ptr=at, length=locs[i].size,
                                                             device="cuda", device_index=device),
                                       0, locs[i].size))
                owner.append(i)
                at += locs[i].size
        try:
            for code, i in zip(self.read_ranges(reads), owner, strict=True):
                if code < 0 and results[i] >= 0:
                    results[i] = code
            if taken is not None:
                self._scatter_gpu(taken[0], device, gpu, where, locs, results)
        finally:
            if taken is not None:
                taken[0].give(device, taken[1])
        for i, tmp, arrs in staged:
            if results[i] >= 0:
                _scatter(tmp, arrs)
        if self.config.verify_checksum:
            for i, loc in enumerate(locs):
                if results[i] >= 0 and loc.checksum and \
                        parts_checksum_ok(loc.checksum, parts[i], loc.size) is False:
                    results[i] = int(ErrorCode.CHECKSUM_MISMATCH)
        return results

    @staticmethod
    def _scatter_gpu(staging: DeviceStaging, device: int,
                     gpu: list[tuple[int, list[tuple[int, int]]]], where: dict[int, int],
                     locs: Sequence[Location], results: list[int]) -> None:
        """Scatter the keys read into device staging (at ``where[key]``) over
        their GPU parts; keys whose read failed are skipped."""
        per_key: list[list[tuple[int, int, int]]] = []
        done: list[int] = []
        for i, regions in gpu:
            if results[i] < 0:
                continue
            src, left = where[i], locs[i].size
            copies = []
            for ptr, n in regions:
                n = min(n, left)
                if n <= 0:
                    break
                copies.append((ptr, src, n))
                src += n
                left -= n
            per_key.append(copies)
            done.append(i)
        try:
            run_copies(staging.rt, plan_copies(per_key), device)
        except Exception as exc:
            log.warning("GPU scatter of %d keys failed: %s", len(done), exc)
            for i in done:
                results[i] = int(ErrorCode.TRANSFER_FAIL)

    def _scatter_inline(self, loc: Location, parts: Sequence[Any]) -> int | None:
        """Scatter a small object from its nearest same-host shm replica into
        host parts with plain numpy copies (no per-part engine bookkeeping):
        the object size, or LEASE_EXPIRED when the copy ended after the read
        lease. None when that path does not apply (read ranges instead)."""
        if not loc.replicas or loc.size >= _GATHER_MAX or len(parts) < 2:
            return None
        src = self._inline_region(loc.replicas[0], loc.size)
        if src is None:
            return None
        arrs = _host_arrays(parts, writeable=True)
        if arrs is None:
            return None
        _scatter(src, arrs)
        return loc.size if time.monotonic() <= loc.deadline else int(ErrorCode.LEASE_EXPIRED)

    def batch_get_ranges(self, fragments: Sequence[tuple[str, Any, int, int]]) -> list[int]:
        """Read byte ranges of objects: each fragment ``(key, buffer, src_offset,
        length)`` copies ``length`` bytes from ``src_offset`` of the object into
        the start of ``buffer``. One master RPC for the distinct keys, one
        transfer batch. Per fragment the :meth:`read_ranges` result."""
        keys = list(dict.fromkeys(f[0] for f in fragments))
        if not keys:
            return []
        where = dict(zip(keys, self.batch_locate(keys), strict=True))
        return self.read_ranges([RangeRead(where[k], b, int(o), int(n))
                                 for k, b, o, n in fragments])

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        """Remove many keys in one RPC; per key OK, OBJECT_NOT_FOUND,
        OBJECT_HAS_LEASE (leased, unless ``force``) or INVALID_KEY."""
        self._check_open()
        codes = [ErrorCode.OK] * len(keys)
        valid = [i for i, k in enumerate(keys)
                 if type(k) is str and k and len(k) <= MAX_KEY_LENGTH]
        for i in set(range(len(keys))) - set(valid):
            codes[i] = ErrorCode.INVALID_KEY
        if valid:
            res = self._call(BatchRemove([keys[i] for i in valid], bool(force)))
            for i, code in zip(valid, res.codes, strict=True):
                codes[i] = self._code(code)
        return codes

    def remove_by_regex(self, pattern: str, force: bool = False, prefix: str = "",
                        exclude_prefix: str = "") -> int:
        """Remove every unleased object (every with ``force``) whose key starts
        with ``prefix`` and, with it stripped, matches ``pattern`` (``re.search``;
        "" matches all); keys starting with ``exclude_prefix`` stay. Returns the
        count. StoreError(INVALID_PARAMS) for a bad pattern."""
        return self._call(RemoveByRegex(pattern, bool(force), prefix, exclude_prefix)).removed

    def batch_replica_clear(self, keys: Sequence[str], segment_id: str = "") -> list[ErrorCode]:
        """Clear each key's replicas on ``segment_id`` ("" = every replica: the
        object goes) in one RPC; per key OK, PERMISSION_DENIED (another client
        wrote it), OBJECT_HAS_LEASE, OBJECT_NOT_FOUND (none there) or INVALID_KEY."""
        self._check_open()
        codes = [ErrorCode.INVALID_KEY] * len(keys)
        valid = [i for i, k in enumerate(keys)
                 if type(k) is str and k and len(k) <= MAX_KEY_LENGTH]
        if valid:
            res = self._call(BatchReplicaClear(self.client_id, [keys[i] for i in valid],
                                               segment_id))
            for i, code in zip(valid, res.codes, strict=True):
                codes[i] = self._code(code)
        return codes

    def create_copy_task(self, key: str, targets: Sequence[str]) -> int:
        """Start copying ``key``'s replica onto each segment of ``targets``; the
        task id (:meth:`query_task`). Raises StoreError: OBJECT_NOT_FOUND,
        INVALID_PARAMS (unknown target), NO_AVAILABLE_HANDLE,
        OBJECT_HAS_REPLICATION_TASK."""
        return self._call(CreateCopyTask(self._valid_key(key), list(targets))).task_id

    def create_move_task(self, key: str, source: str, target: str) -> int:
        """Start moving ``key``'s replica from segment ``source`` to ``target``;
        the task id. Errors as :meth:`create_copy_task`."""
        return self._call(CreateMoveTask(self._valid_key(key), source, target)).task_id

    def query_task(self, task_id: int) -> QueryTaskReply:
        """A copy/move task's state; StoreError(TASK_NOT_FOUND) when unknown."""
        return self._call(QueryTask(int(task_id)))

    def describe_segment(self, segment_id: str) -> SegmentDescriptor | None:
        """The descriptor of a segment this client has seen (its own, or one a
        master reply named), or None."""
        own = self._own_descs.get(segment_id)
        return own if own is not None else self._known.get(segment_id)


@dataclass(frozen=True, slots=True)
class ReplicaLocation:
    """One complete replica as a reader sees it: segment, object size, the
    segment's host and kind (memory or file), and whether it is on this host
    (read through shared memory or the file) or another (over the network)."""

    segment_id: str
    size: int
    host_id: str
    kind: SegmentKind
    same_host: bool


_GATHER_MAX = 4 << 20  # objects below this gather/scatter their parts in one pass


class _CapsMerge:
    """One capability list for a transfer batch built from several replies:
    each reply's tokens are appended once; ``base(caps)`` is where they start."""

    def __init__(self) -> None:
        self.caps: list[bytes] = []
        self._at: dict[int, int] = {}

    def base(self, caps: list[bytes]) -> int:
        at = self._at.get(id(caps))
        if at is None:
            at = self._at[id(caps)] = len(self.caps)
            self.caps.extend(caps)
        return at


def _sub_replica(r: ReplicaDescriptor, offset: int, length: int, cap_base: int
                 ) -> ReplicaDescriptor:
    """``length`` bytes at ``offset`` inside replica ``r`` (the same capability
    token, re-indexed into the batch's merged caps: a transfer server accepts
    any range inside the granted one)."""
    return ReplicaDescriptor(r.segment_id, r.offset + offset, length, r.status,
                             r.cap + cap_base if r.cap >= 0 else -1)


def _scatter(src: np.ndarray, parts: Sequence[Any]) -> None:
    """Copy ``src`` over the flat uint8 arrays ``parts`` in order (the last one
    may be filled partly)."""
    off, size = 0, src.size
    for a in parts:
        end = off + a.size
        if end >= size:
            np.copyto(a[:size - off], src[off:size])
            return
        np.copyto(a, src[off:end])
        off = end


def _host_arrays(parts: Sequence[Any], writeable: bool = False) -> list[np.ndarray] | None:
    """Flat uint8 host arrays of every part, or None as soon as one is not
    host memory (or not writeable, with ``writeable``)."""
    out = []
    for p in parts:
        a = _flat_u8(p)
        if a is None or (writeable and not a.flags.writeable):
            return None
        out.append(a)
    return out


def _flat_u8(buf: Any) -> np.ndarray | None:
    """A flat uint8 host array of ``buf`` (the common case, a flat uint8
    numpy view, without a call), or None."""
    if type(buf) is np.ndarray and buf.dtype == np.uint8 and buf.ndim == 1 \
            and buf.flags.c_contiguous:
        return buf
    return host_array(buf)


class _ReservationLost(ObjectNotFound):
    """A put's commit reached a new master leader that never heard of its
    reservation (granted by the old one): the put is done again."""


def _config_for(config: ReplicateConfig | None, idx: Sequence[int]) -> ReplicateConfig | None:
    """``config`` for the keys at ``idx`` of a batch (``group_ids`` picked)."""
    if config is None or config.group_ids is None:
        return config
    return replace(config, group_ids=[config.group_ids[i] for i in idx])


@dataclass(slots=True)
class Reservation:
    """One key of :meth:`Client.batch_put_reserve`: ``code`` OK with the
    ``replicas`` to write ``size`` bytes into and the capability tokens
    (``caps``) they point at, or why not."""

    code: ErrorCode
    size: int
    replicas: list[ReplicaDescriptor]
    caps: list[bytes]


@dataclass(slots=True)
class RangeWrite:
    """Write ``length`` bytes of ``buffer`` (None: all of it) at ``offset`` of
    every replica of a reserved object (``caps``: its reservation's tokens)."""

    buffer: Any
    replicas: list[ReplicaDescriptor]
    offset: int = 0
    length: int | None = None
    caps: list[bytes] = field(default_factory=list)

    def nbytes(self) -> int:
        return buffer_nbytes(self.buffer) if self.length is None else self.length


@dataclass(slots=True)
class Location:
    """A located object (:meth:`Client.batch_locate`): ``code`` OK with its
    size, checksum, read-lease deadline (monotonic), complete replicas nearest
    first and the capability tokens they point at, or why not."""

    code: ErrorCode
    size: int = 0
    checksum: str | None = None
    deadline: float = 0.0
    replicas: list[ReplicaDescriptor] = field(default_factory=list)
    caps: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class RangeRead:
    """Read ``length`` bytes from ``src_offset`` of a located object into the
    start of ``buffer``."""

    location: Location
    buffer: Any
    src_offset: int
    length: int


def parts_checksum(algo: str, parts: Sequence[Any]) -> str | None:
    """:func:`checksum_of` over the concatenation of ``parts`` without joining
    them; None when a part is not host memory (GPU buffers are not hashed)."""
    views = [host_view(p) for p in parts]
    if any(v is None for v in views):
        return None
    if algo == "xxh64":
        import xxhash  # type: ignore[import-not-found]  # resolve_checksum_algo checked it

        h = xxhash.xxh64()
        for v in views:
            h.update(v)
        return "xxh64:" + str(h.hexdigest())
    crc = 0
    for v in views:
        assert v is not None
        crc = zlib.crc32(v, crc)
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def parts_checksum_ok(expected: str, parts: Sequence[Any], size: int) -> bool | None:
    """Whether the first ``size`` bytes of ``parts`` match ``expected``; None
    when that cannot be checked here (GPU part, unknown algorithm)."""
    algo = expected.partition(":")[0]
    if algo not in ("crc32", "xxh64") or resolve_checksum_algo(
            "xxhash" if algo == "xxh64" else "crc32") != algo:
        return None
    trimmed: list[Any] = []
    left = size
    for p in parts:
        if left <= 0:
            break
        v = host_view(p)
        if v is None:
            return None
        trimmed.append(v[:left])
        left -= len(trimmed[-1])
    got = parts_checksum(algo, trimmed)
    return None if got is None else got == expected

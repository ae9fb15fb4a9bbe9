"""The store client: Put/Get of objects held in the pool, with buffers and replicas.

:class:`Client` is a facade: each method states its contract and hands the
call to the part that does it (:mod:`kvpool.store.lifecycle` holds them):

- :mod:`kvpool.store.session`: the master session (RPC stubs per thread,
  leader following, terms across an HA failover);
- :mod:`kvpool.store.writes`: the one put path (start, write, end; spare
  allocations, :mod:`kvpool.store.spares`);
- :mod:`kvpool.store.reads`: locate, then one read loop for every read form;
  :mod:`kvpool.store.replicas` orders a key's replicas nearest first;
- :mod:`kvpool.store.multibuffer`: values stored from / read into several
  buffers; :mod:`kvpool.store.pipelined`: reads in stages, keys located in
  one process and read in another;
- :mod:`kvpool.store.admin`: queries and removals;
- :mod:`kvpool.store.segment_host`: the memory and disk this process
  contributes (mount, liveness, guard), with the transfer engine
  (:mod:`kvpool.transfer`) and its segment registry shared by all of them.

Single-key calls raise typed errors (:mod:`kvpool.store.errors`); batch calls
answer per key and raise only for call-level failures. Every call acts for
the client's tenant (``ClientConfig.tenant``, docs/tenants.md): the keys it
names, lists, counts and removes are that tenant's only.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    Checksum,
    QueryTaskReply,
    SegmentDescriptor,
    SegmentInfo,
    StatsReply,
)
from kvpool.store.config import ClientConfig, ReplicateConfig, default_host_id
from kvpool.store.lifecycle import ClientParts
from kvpool.store.located import Located, Location
from kvpool.store.multibuffer import parts_checksum, parts_checksum_ok
from kvpool.store.reads import RangeRead
from kvpool.store.replicas import ReplicaLocation
from kvpool.store.segment_host import SegmentHost
from kvpool.store.writes import RangeWrite, Reservation

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


def _config(config: ClientConfig | None, overrides: dict[str, Any]) -> ClientConfig:
    if config is None:
        config = ClientConfig(**overrides)
    elif overrides:
        raise TypeError("pass either a ClientConfig or keyword overrides, not both")
    config.validate()
    return config


class Client:
    """A store client (see module docstring). Thread-safe for concurrent calls.

    Use as a context manager, or call :meth:`setup` then :meth:`close`.
    """

    def __init__(self, config: ClientConfig | None = None, **overrides: Any) -> None:
        self.config = cfg = _config(config, overrides)
        self._parts = ClientParts(cfg, uuid.uuid4().hex, cfg.host_id or default_host_id())
        self.client_id, self.host_id = self._parts.client_id, self._parts.host_id
        # close(), garbage collection or interpreter exit: whichever comes first
        self._finalizer = weakref.finalize(self, self._parts.release)

    # ------------------------------------------------------------------ lifecycle

    @property
    def tenant(self) -> str:
        """The tenant every call of this client acts for (``config.tenant``;
        ``default`` unless configured): its keys are that tenant's only."""
        return self.config.tenant

    @property
    def segment_ids(self) -> list[str]:
        """Ids of the segments this client contributes (empty for a pure client)."""
        return self._parts.host.segment_ids

    @property
    def shm_names(self) -> list[str]:
        """/dev/shm names of this client's memory segments."""
        return self._parts.host.shm_names

    @property
    def endpoint(self) -> str:
        """This process's transfer server (``tcp://host:port``)."""
        engine = self._parts.engine
        return str(engine.endpoint) if engine is not None else ""

    @property
    def engine(self) -> Any:
        """The underlying :class:`kvpool.transfer.TransferEngine`."""
        self._parts.session.check()
        return self._parts.engine

    @property
    def remount_count(self) -> int:
        """How many times the ping thread re-mounted after the master asked."""
        return self._parts.host.remounts

    @property
    def segment_host(self) -> SegmentHost:
        """The owner of this client's segments: liveness, guard, janitor."""
        return self._parts.host

    def setup(self) -> Client:
        """Connect, create and mount segments, start the transfer server and pinger.

        Raises :class:`MasterUnreachable` if the master does not answer within
        ``rpc_timeout_s``; on any failure everything created so far is released.
        """
        self._parts.setup()
        return self

    def close(self) -> None:
        """Unmount this client's segments and release every resource. Idempotent.

        A Client that is garbage-collected, or still open at interpreter exit,
        is released the same way; one whose process dies (SIGTERM's default
        action, kill -9) is released by its guard process."""
        self._parts.close()

    def __enter__(self) -> Client:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ put

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> None:
        """Store ``value`` (bytes-like or any buffer) under ``key``.

        Raises AlreadyExists (value unchanged), NoSpace, QuotaExceeded (the
        tenant is at its quota; nothing stored), TransferFailed (the put was
        revoked), MasterUnreachable, StoreTimeout, StoreError(INVALID_KEY).
        """
        self._parts.writes.put(key, value, config)

    def put_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> None:
        """Store the bytes of ``buffer`` (host or GPU, raw or a registered
        BufferHandle) under ``key`` without an intermediate copy. Errors as
        :meth:`put`; a write refused as a grant of an older master term (HA
        failover) is revoked and the put asked of the master once more (then
        StaleEpoch), and a put whose grant a master failover lost before its
        commit is done again at the new leader, once."""
        self._parts.writes.put(key, buffer, config)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> list[ErrorCode]:
        """Put many values: one master call to start, one transfer batch, one to
        commit. Returns a per-key :class:`ErrorCode` (OK, OBJECT_ALREADY_EXISTS,
        NO_AVAILABLE_HANDLE, TRANSFER_FAIL, INVALID_KEY, ...). Raises only for
        call-level failures (MasterUnreachable, StoreTimeout when its transfer
        batch overruns, closed client, length mismatch).
        """
        return self._parts.writes.put_many(keys, values, config)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any],
                       config: ReplicateConfig | None = None,
                       upsert: bool = False) -> list[ErrorCode]:
        """Zero-copy :meth:`put_batch` from host or GPU buffers, same result
        contract. ``upsert``: insert or replace. A batch of one size with every
        default may write into spare allocations the previous commit handed
        out and commit with one master call (``ClientConfig.reserve_batch_puts``)."""
        return self._parts.writes.put_many(keys, buffers, config, upsert)

    # ------------------------------------------------------------------ get

    def get(self, key: str) -> bytes:
        """Return the value of ``key``.

        Raises ObjectNotFound, LeaseExpired, TransferFailed (every replica
        failed), ChecksumMismatch, MasterUnreachable, StoreTimeout, and
        StaleEpoch when the grants were refused as of an older master term
        twice (after a failover the first refusal re-asks the master).
        """
        return self._parts.reads.get(key)

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the value of ``key`` into ``buffer`` (host or GPU, raw or a
        registered BufferHandle); return the number of bytes read.

        Raises BufferTooSmall (nothing is read) and the errors of :meth:`get`.
        """
        return self._parts.reads.get_into(key, buffer)

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of many keys (None where missing or unreadable): one master
        call, one transfer batch."""
        return self._parts.reads.get_batch(keys)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Read many keys into their buffers; per key the bytes read or a
        negative ErrorCode (OBJECT_NOT_FOUND, BUFFER_OVERFLOW, ...). One master
        call, one transfer batch."""
        return self._parts.reads.batch_get_into(keys, buffers)

    def batch_get_into_parts(self, keys: Sequence[str], buffers: Sequence[Any],
                             parts: Sequence[Sequence[int]],
                             on_part: Callable[[int, list[int]], None],
                             located: Located | None = None) -> list[int]:
        """:meth:`batch_get_into` for pipelined consumers: the keys of ``parts``
        (lists of indices into ``keys``, the *stages*) are read stage after
        stage, one transfer batch each, and ``on_part(p, results)`` runs after
        stage ``p`` (results as in batch_get_into, in the stage's order) so the
        caller can use it while later stages still move. Stage 0's keys are
        located by a call of their own, the others by a second call sent at once
        from a helper thread (answered while stage 0 moves). Indices in no stage
        are located, not read. Each call's read lease covers its keys: stages
        still unread when it ends fail with LEASE_EXPIRED; a failed second call
        fails the later stages' keys with its code. ``located`` (from
        :meth:`locate_for_reads`, here or in another process of this host) that
        answers every key of stage 0 with enough lease left replaces stage 0's
        call: the first transfer starts at once."""
        return self._parts.pipelined.read(keys, buffers, parts, on_part, located)

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[int]:
        """Copy ``[src_offset, src_offset + length)`` of each read's located object
        into the start of its buffer; no master call. Round k reads every pending
        range from its object's k-th nearest replica. Per read the bytes read, or
        a negative code: INVALID_PARAMS (range outside the object or larger than
        the buffer), LEASE_EXPIRED, TRANSFER_FAIL (every replica failed),
        STALE_EPOCH (refused as a grant of an older master term: locate again),
        the location's own code."""
        return self._parts.reads.read_ranges(reads)

    def batch_get_ranges(self, fragments: Sequence[tuple[str, Any, int, int]]) -> list[int]:
        """Read byte ranges of objects: each fragment ``(key, buffer, src_offset,
        length)`` copies ``length`` bytes from ``src_offset`` of the object into
        the start of ``buffer``. One master call for the distinct keys, one
        transfer batch. Per fragment the :meth:`read_ranges` result."""
        return self._parts.reads.batch_get_ranges(fragments)

    # ------------------------------------------------------------------ locations

    def batch_locate(self, keys: Sequence[str]) -> list[Location]:
        """Where each key can be read from (one master call; grants a read lease
        per found key): a :class:`Location` with code OK, the size, checksum,
        lease deadline and complete replicas nearest first, or the code why not
        (INVALID_KEY, OBJECT_NOT_FOUND...)."""
        return self._parts.reads.locate(keys)

    def locate_for_reads(self, keys: Sequence[str]) -> Located:
        """One locate of ``keys`` (grants read leases, like :meth:`batch_exists`),
        kept whole: :meth:`replica_locations` says where each key is, and
        :meth:`batch_get_into_parts` (in this process or another of this host)
        can read stage 0 from it without asking again."""
        return self._parts.pipelined.locate(keys)

    def replica_locations(self, located: Located) -> list[list[ReplicaLocation] | None]:
        """Per key of ``located``: its complete replicas, nearest first (the
        order reads try them), or None where it is missing."""
        return self._parts.pipelined.replica_locations(located)

    def batch_replica_locations(self, keys: Sequence[str]) -> list[list[ReplicaLocation] | None]:
        """Where each key's complete replicas are, nearest first; None for a
        missing key. One master call; grants read leases, like
        :meth:`batch_exists`. Lets a caller estimate a read's time from what it
        measured per tier and peer before reading."""
        return self.replica_locations(self.locate_for_reads(keys))

    def replica_segments(self, key: str) -> list[str]:
        """Segment ids holding a complete replica of ``key``, nearest first
        (grants a read lease, like exists; ObjectNotFound when missing)."""
        return [r.segment_id for r in self._parts.reads.locate_one(key).replicas]

    def describe_segment(self, segment_id: str) -> SegmentDescriptor | None:
        """The descriptor of a segment this client has seen (its own, or one a
        master reply named), or None."""
        engine = self._parts.engine
        return engine.registry.get(segment_id) if engine is not None else None

    # ------------------------------------------------------------------ granted writes
    # The primitives under Mooncake's multi-buffer, range and session calls
    # (store/mooncake_*.py): grant (BATCH_PUT_START), write ranges into every
    # replica, then end (BATCH_PUT_END) or revoke (BATCH_PUT_REVOKE).

    def batch_put_reserve(self, keys: Sequence[str], sizes: Sequence[int],
                          config: ReplicateConfig | None = None,
                          checksums: Sequence[Checksum] | None = None,
                          upsert: bool = False) -> list[Reservation]:
        """Allocate ``sizes[i]`` bytes for ``keys[i]`` on every replica, moving
        no data. Per key a :class:`Reservation`: code OK with its replicas (and
        the capability tokens they point at), or why not (INVALID_KEY,
        INVALID_PARAMS for a size <= 0, OBJECT_ALREADY_EXISTS,
        NO_AVAILABLE_HANDLE...). A granted key must be ended with
        :meth:`batch_put_commit` or revoked with :meth:`batch_put_abort` (the
        master discards it after ``put_start_discard_timeout_s`` otherwise).
        ``checksums[i]`` (a :func:`parts_checksum` string) is recorded with the
        object and verified by readers. ``upsert``: an existing key is replaced:
        its object stays readable until the end swaps the new one in."""
        return self._parts.writes.grant(keys, sizes, config, checksums, upsert)

    def write_ranges(self, writes: Sequence[RangeWrite],
                     timeout_s: float | None = None) -> list[tuple[bool, str]]:
        """Copy each write's buffer into ``[offset, offset + length)`` of every one
        of its replicas: one transfer batch, no master call. Per write ``(ok,
        error)``; a range outside the granted object fails without moving bytes.
        Raises StoreTimeout when the batch overruns ``timeout_s`` (default
        ``transfer_timeout_s``)."""
        return self._parts.writes.write_ranges(writes, timeout_s)

    def batch_put_commit(self, keys: Sequence[str]) -> list[ErrorCode]:
        """Make granted keys readable (BATCH_PUT_END); per key OK or why not."""
        return self._parts.writes.end_granted(keys)

    def batch_put_abort(self, keys: Sequence[str]) -> None:
        """Give granted keys back (BATCH_PUT_REVOKE); failures are logged."""
        self._parts.session.revoke(list(keys))

    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                        config: ReplicateConfig | None = None,
                        upsert: bool = False) -> list[ErrorCode]:
        """Store each key's value as the concatenation of its parts (host or GPU
        buffers, raw or registered handles): one grant, one transfer batch, one
        end. Per key the :meth:`batch_put_from` codes."""
        return self._parts.multi.put(keys, parts, config, upsert)

    def batch_get_parts(self, keys: Sequence[str],
                        parts: Sequence[Sequence[Any]]) -> list[int]:
        """Read each key's value scattered over its parts in order (the first
        part gets the first bytes): one master call, one transfer batch. Per key
        the object size, or a negative code: BUFFER_OVERFLOW (the parts hold
        fewer bytes than the object; nothing is read), CHECKSUM_MISMATCH, and
        the codes of :meth:`read_ranges`."""
        return self._parts.multi.get(keys, parts)

    # ------------------------------------------------------------------ buffers

    def register_buffer(self, buffer: Any, device: str | None = None) -> Any:
        """Register host or GPU memory for repeated zero-copy put_from/get_into;
        returns a BufferHandle usable wherever a buffer is taken. ``device``
        ("cpu"/"cuda") classifies a raw ``(address, length)``."""
        return self._parts.register_buffer(buffer, device)

    def unregister_buffer(self, handle: Any) -> None:
        """Release a handle from :meth:`register_buffer`."""
        self._parts.unregister_buffer(handle)

    # ------------------------------------------------------------------ queries and removals

    def exists(self, key: str) -> bool:
        """True when ``key`` has a complete replica (grants a read lease)."""
        return self._parts.admin.exists(key)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` for many keys in one call, in input order ([] for [])."""
        return self._parts.admin.batch_exists(keys)

    def get_size(self, key: str) -> int:
        """Size in bytes of ``key``'s value (ObjectNotFound if missing)."""
        return self._parts.admin.get_size(key)

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``. A leased object raises StoreError(OBJECT_HAS_LEASE)
        unless ``force``; a missing one raises ObjectNotFound."""
        self._parts.admin.remove(key, force)

    def remove_all(self, force: bool = False) -> int:
        """Remove every (unleased, or all with ``force``) object; return the count."""
        return self._parts.admin.remove_all(force)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        """Remove many keys in one call; per key OK, OBJECT_NOT_FOUND,
        OBJECT_HAS_LEASE (leased, unless ``force``) or INVALID_KEY."""
        return self._parts.admin.batch_remove(keys, force)

    def remove_by_regex(self, pattern: str, force: bool = False, prefix: str = "",
                        exclude_prefix: str = "") -> int:
        """Remove every unleased object (every with ``force``) whose key starts
        with ``prefix`` and, with it stripped, matches ``pattern`` (``re.search``;
        "" matches all); keys starting with ``exclude_prefix`` stay. Returns the
        count. StoreError(INVALID_PARAMS) for a bad pattern."""
        return self._parts.admin.remove_by_regex(pattern, force, prefix, exclude_prefix)

    def batch_replica_clear(self, keys: Sequence[str], segment_id: str = "") -> list[ErrorCode]:
        """Clear each key's replicas on ``segment_id`` ("" = every replica: the
        object goes) in one call; per key OK, PERMISSION_DENIED (another client
        wrote it), OBJECT_HAS_LEASE, OBJECT_NOT_FOUND (none there) or INVALID_KEY."""
        return self._parts.admin.batch_replica_clear(keys, segment_id)

    def stats(self) -> StatsReply:
        """The master's STATS (uptime, objects, bytes used/capacity, ...)."""
        return self._parts.admin.stats()

    def list_segments(self) -> list[SegmentInfo]:
        """The master's LIST_SEGMENTS: every mounted segment with used/capacity."""
        return self._parts.admin.list_segments()

    def create_copy_task(self, key: str, targets: Sequence[str]) -> int:
        """Start copying ``key``'s replica onto each segment of ``targets``; the
        task id (:meth:`query_task`). Raises StoreError: OBJECT_NOT_FOUND,
        INVALID_PARAMS (unknown target), NO_AVAILABLE_HANDLE,
        OBJECT_HAS_REPLICATION_TASK."""
        return self._parts.admin.create_copy_task(key, targets)

    def create_move_task(self, key: str, source: str, target: str) -> int:
        """Start moving ``key``'s replica from segment ``source`` to ``target``;
        the task id. Errors as :meth:`create_copy_task`."""
        return self._parts.admin.create_move_task(key, source, target)

    def query_task(self, task_id: int) -> QueryTaskReply:
        """A copy/move task's state; StoreError(TASK_NOT_FOUND) when unknown."""
        return self._parts.admin.query_task(task_id)


"""The store client: Put/Get of objects held in the pool, with buffers and replicas.

One :class:`Client` per process. ``setup()`` connects to the master, creates
and mounts this process's memory segment (``memory_size`` > 0), starts its
transfer server (inside :class:`kvpool.transfer.TransferEngine`) and a
background ping thread that re-mounts the segments when the master asks
(e.g. after a master restart). ``close()`` unmounts and releases all of it.

Hot paths, kept lean on purpose:

- put: one PUT_START (allocates every replica) -> one transfer batch writing
  every replica -> one PUT_END; any failed write -> PUT_REVOKE and raise.
- get: one GET_REPLICA_LIST (grants a read lease) -> READ from the nearest
  complete replica (own segment, same host, remote, file last); on a transfer
  failure the next replica; a read that ends after the lease deadline raises
  LEASE_EXPIRED instead of returning bytes that may have been evicted.
- batch forms: one master batch RPC and one transfer batch per call (a
  second transfer batch only for keys whose first replica failed).

Segment descriptors are cached per segment id and handed to the engine once,
so the engine keeps its shm mappings / connections across calls.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    Op,
    ReplicaDescriptor,
    ReplicaStatus,
    SegmentDescriptor,
    SegmentKind,
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
from kvpool.store.config import ClientConfig, ReplicateConfig, default_host_id
from kvpool.store.errors import (
    BufferTooSmall,
    ChecksumMismatch,
    LeaseExpired,
    MasterUnreachable,
    ObjectNotFound,
    StoreError,
    StoreTimeout,
    TransferFailed,
    error_for_code,
)

__all__ = ["Client", "ClientConfig", "ReplicateConfig"]

log = logging.getLogger(__name__)

_TIER_POLL_S = 0.1  # ping period while tier tasks keep coming
_TIER_BUSY_S = 5.0  # ... for this long after the last reply that carried tasks

_LAZY_BYTES = object()  # batch-read target: "allocate a bytes result when needed"
_SUSPECT_S = 10.0
_MAX_RPC_SOCKETS = 16  # per client; threads beyond share them
_STATUS = {int(s): s for s in ReplicaStatus}  # how long a segment that failed a read is tried last


@dataclass(slots=True)
class _ReadPlan:
    """Where one key's bytes can be read from, nearest replica first."""

    size: int
    checksum: str | None
    deadline: float  # monotonic time the read lease ends
    replicas: list[ReplicaDescriptor]


def _master_error(exc: MasterRPCError) -> StoreError:
    return error_for_code(exc.code, str(exc))


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
        self._ping_master: MasterClient | None = None
        self._engine: Any = None
        self._local_segments: list[Any] = []  # MemorySegment / file segments we own
        self._own_descs: dict[str, SegmentDescriptor] = {}
        self._known: dict[str, SegmentDescriptor] = {}  # segment descriptors given to the engine
        self._known_lock = threading.Lock()
        # segment id -> monotonic time until which its replicas are tried last
        # (a read from it just failed or timed out: e.g. its owner died)
        self._suspect: dict[str, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # ping now (the tier runner drained its tasks)
        self._ping_thread: threading.Thread | None = None
        self._remounts = 0
        self._closed = False
        self._started = False
        self._checksum_algo = resolve_checksum_algo(config.checksum)
        self._transfer_mod: Any = None
        self._inline: InlineShm | None = None
        self._tier_runner: Any = None  # store.tier_tasks.TierTaskRunner (segment owners)

    # ------------------------------------------------------------------ lifecycle

    @property
    def segment_ids(self) -> list[str]:
        """Ids of the segments this client contributes (empty for a pure client)."""
        return list(self._own_descs)

    @property
    def shm_names(self) -> list[str]:
        """/dev/shm names of this client's memory segments."""
        return [d.name for d in self._own_descs.values() if d.kind == SegmentKind.MEMORY]

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
        return self._remounts

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
        self._master = self._new_master()
        self._ping_master = self._new_master()
        # Fail fast (typed) when the master is not there, before allocating memory.
        try:
            self._ping_master.call(Op.PING, client_id=self.client_id)
        except MasterRPCError as exc:
            raise MasterUnreachable(
                f"master {cfg.master_address} unreachable: {exc}", exc.code
            ) from exc
        tcfg = transfer.load_transfer_config(cfg.transfer_config, cfg.transfer_overrides or None)
        self._engine = transfer.TransferEngine(
            tcfg, host_id=self.host_id, bind_host=cfg.bind_host, port=cfg.transfer_port,
            curve=cfg.curve,
        )
        self._inline = InlineShm(list(tcfg.rules), self.host_id, cfg.inline_shm)
        port = self._engine.endpoint.rsplit(":", 1)[-1]
        base_id = cfg.segment_id or f"{self.host_id}:{port}"
        if cfg.memory_size > 0:
            seg = transfer.MemorySegment.create(base_id, cfg.memory_size, prefault=cfg.prefault)
            self._local_segments.append(seg)
            self._engine.add_local_segment(seg)
            self._inline.add_own(seg.segment_id, seg.array())
            desc = seg.descriptor(self.client_id, self.host_id, self._engine.endpoint)
            self._own_descs[desc.segment_id] = desc
            self._start_tier_runner()
        self._own_descs.update(self._create_file_segments(base_id))
        for desc in self._own_descs.values():
            self._mount(desc)
        self._ping_thread = threading.Thread(
            target=self._ping_loop, name=f"kvpool-ping-{self.client_id[:6]}", daemon=True
        )
        self._ping_thread.start()
        log.info(
            "client %s up: host %s, segments %s, endpoint %s",
            self.client_id[:8], self.host_id, list(self._own_descs), self._engine.endpoint,
        )

    def _create_file_segments(self, base_id: str) -> dict[str, SegmentDescriptor]:
        """Create or reopen the SSD-tier FILE segment (``disk_dir``/``disk_size``).

        An existing segment file in ``disk_dir`` is reopened (warm restart:
        its id comes from the file header, so the master re-adopts the objects
        recorded in it); a file that does not match (foreign, truncated,
        another size) is refused with ``SEGMENT_MISMATCH`` and left untouched.
        """
        cfg = self.config
        if not cfg.disk_dir or cfg.disk_size <= 0:
            return {}
        from kvpool.transfer.file_segment import FileSegment

        seg = FileSegment.create(f"{base_id}:disk", cfg.disk_dir, cfg.disk_size)
        self._local_segments.append(seg)
        self._engine.add_local_segment(seg)
        desc = seg.descriptor(self.client_id, self.host_id, self._engine.endpoint)
        if self._tier_runner is None:
            self._start_tier_runner()
        return {desc.segment_id: desc}

    def _start_tier_runner(self) -> None:
        """The node side of the SSD tier: run the copy tasks (offload,
        promotion) the master hands out in PING replies."""
        from kvpool.store.tier_tasks import TierTaskRunner

        self._tier_runner = TierTaskRunner(
            self._engine, self._new_master(),
            self.client_id,
            learn_segment=lambda d: self._learn_segments({d.segment_id: d.to_wire()}),
            transfer_timeout_s=self.config.transfer_timeout_s,
            on_drained=self._wake.set)  # fetch the next tasks without waiting a ping interval

    def _new_master(self) -> MasterClient:
        """A master RPC stub; with CURVE when the policy makes it active for the
        master's address (off for loopback unless forced, on otherwise)."""
        cfg = self.config
        curve = cfg.curve
        addr = cfg.master_address if "://" in cfg.master_address \
            else f"tcp://{cfg.master_address}"
        if not curve.active(addr):
            return MasterClient(cfg.master_address, timeout_s=cfg.rpc_timeout_s)
        kp = curve.keypair()
        return MasterClient(cfg.master_address, timeout_s=cfg.rpc_timeout_s,
                            curve_server_key=curve.server_public_key(),
                            curve_keypair=(kp.public, kp.secret))

    def _mount(self, desc: SegmentDescriptor) -> None:
        assert self._master is not None
        try:
            res = self._master.call(Op.MOUNT_SEGMENT, client_id=self.client_id,
                                    segment=desc.to_wire())
        except MasterRPCError as exc:
            if exc.code == ErrorCode.SEGMENT_ALREADY_EXISTS:
                return  # already mounted by us (a remount racing a ping)
            raise _master_error(exc) from exc
        key = res.get("capability_key")
        if key and self._engine is not None:
            # issue 7: our transfer server now refuses any READ/WRITE of this
            # segment without a capability the master signed with this key
            self._engine.set_capability_key(desc.segment_id, bytes(key))

    def _ping_loop(self) -> None:
        """Ping every ``ping_interval_s``; re-mount our segments when the master asks."""
        assert self._ping_master is not None
        base_interval = self.config.ping_interval_s
        tier_busy_until = 0.0
        while True:
            # while the master hands out tier copy tasks (offload, promotion),
            # poll for more every _TIER_POLL_S rather than every ping interval
            interval = base_interval
            if time.monotonic() < tier_busy_until:
                interval = min(base_interval, _TIER_POLL_S)
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                res = self._ping_master.call(Op.PING, client_id=self.client_id)
                if res.get("tasks") and self._tier_runner is not None:
                    self._tier_runner.submit(res["tasks"], res.get("segments"))
                    tier_busy_until = time.monotonic() + _TIER_BUSY_S
                remount = bool(res.get("remount"))
                if not remount and self._own_descs and "segment_ids" in res:
                    # the master knows us but lost a segment of ours: mount it again
                    remount = not set(self._own_descs) <= set(res["segment_ids"] or ())
            except MasterRPCError as exc:
                if exc.code != ErrorCode.CLIENT_NOT_FOUND:
                    log.debug("ping failed: %s", exc)
                    continue
                remount = True
            if remount and not self._stop.is_set():
                self._remount()

    def _remount(self) -> None:
        log.info("master asked client %s to re-mount %d segment(s)",
                 self.client_id[:8], len(self._own_descs))
        for desc in list(self._own_descs.values()):
            try:
                self._mount(desc)
            except StoreError as exc:
                log.warning("re-mount of %s failed: %s", desc.segment_id, exc)
                return
        self._remounts += 1

    def close(self) -> None:
        """Unmount this client's segments and release every resource. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._ping_thread is not None:
            self._ping_thread.join(timeout=self.config.rpc_timeout_s + 1)
        if self._tier_runner is not None:
            self._tier_runner.close()
            self._tier_runner.master.close()
        if self._master is not None:
            for seg_id in list(self._own_descs):
                if self._own_descs[seg_id].kind == SegmentKind.FILE:
                    # the SSD tier outlives this process: the master keeps the
                    # segment awaiting us and a restart on the same disk dir
                    # re-adopts its objects (warm restart)
                    continue
                try:
                    self._master.call(
                        Op.UNMOUNT_SEGMENT, client_id=self.client_id, segment_id=seg_id,
                        timeout_s=min(2.0, self.config.rpc_timeout_s),
                    )
                except (MasterRPCError, KVPoolError) as exc:
                    log.debug("unmount %s: %s", seg_id, exc)
        if self._engine is not None:
            for seg_id in list(self._own_descs):
                try:
                    self._engine.remove_local_segment(seg_id)
                except Exception as exc:  # releasing must go on whatever one step raises
                    log.debug("remove_local_segment %s: %s", seg_id, exc)
        if self._inline is not None:
            self._inline.close()
        for seg in self._local_segments:
            try:
                seg.close()
            except Exception as exc:
                log.warning("closing segment: %s", exc)
        self._local_segments.clear()
        if self._engine is not None:
            try:
                self._engine.close()
            except Exception as exc:
                log.warning("closing transfer engine: %s", exc)
        with self._rpc_lock:
            stubs = [*self._rpc_all, self._master, self._ping_master]
            self._rpc_all.clear()
        for m in stubs:
            if m is not None:
                m.close()

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

    def _call(self, op: Op, **args: Any) -> dict[str, Any]:
        self._check_open()
        master = getattr(self._rpc_local, "master", None)
        if master is None:
            master = self._thread_master()
        try:
            return master.call(op, **args)
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

    def _learn_segments(self, segments: dict[str, Any] | None) -> None:
        """Hand new segment descriptors to the engine (once per segment id)."""
        if not segments:
            return
        for seg_id, wire in segments.items():
            known = self._known.get(seg_id)
            if known is not None and known.name == wire.get("name") \
                    and known.client_id == wire.get("client_id"):
                continue
            desc = SegmentDescriptor.from_wire(wire)
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
        """Submit a read batch and wait up to ``timeout``; requests still running
        then are reported FAILED with code TIMEOUT (the caller moves on to
        another replica instead of waiting on a dead peer)."""
        t = self._transfer_mod
        try:
            handle = self._engine.submit(reqs)
        except KVPoolError as exc:
            raise TransferFailed(str(exc), ErrorCode.TRANSFER_FAIL) from exc
        handle.wait(timeout)
        out = []
        for st in handle.status():
            if not st.state.terminal:
                st = t.RequestStatus(t.RequestState.FAILED, st.transport, ErrorCode.TIMEOUT,
                                     [*st.errors, f"no answer within {timeout:.2f}s"])
            out.append(st)
        return out

    @staticmethod
    def _replicas(value: Any) -> list[ReplicaDescriptor]:
        raw = value.get("replicas", []) if isinstance(value, dict) else (value or [])
        # ReplicaDescriptor.from_wire without its per-field conversions (hot path)
        return [ReplicaDescriptor(w[0], w[1], w[2], _STATUS.get(w[3], ReplicaStatus.PROCESSING),
                                  w[4] or b"") for w in raw]

    # ------------------------------------------------------------------ put

    def _put_args(self, config: ReplicateConfig | None) -> dict[str, Any]:
        if config is None:
            return {}  # every PUT_START default
        return config.to_wire_args()

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> None:
        """Store ``value`` (bytes-like or any buffer) under ``key``.

        Raises AlreadyExists (value unchanged), NoSpace, TransferFailed (the
        put was revoked), MasterUnreachable, StoreTimeout, StoreError(INVALID_KEY).
        """
        self.put_from(key, value, config)

    def put_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> None:
        """Store the bytes of ``buffer`` (host or GPU, raw or a registered BufferHandle)
        under ``key`` without an intermediate copy. Errors as :meth:`put`."""
        self._check_open()
        self._valid_key(key)
        size = buffer_nbytes(buffer)
        if size <= 0:
            raise StoreError("cannot put an empty value", ErrorCode.INVALID_PARAMS)
        args = self._put_args(config)
        if self._checksum_algo is not None:
            checksum = self._checksum(buffer)
            if checksum is not None:
                args["checksum"] = checksum
        res = self._call(Op.PUT_START, client_id=self.client_id, key=key, size=size, **args)
        self._learn_segments(res.get("segments"))
        replicas = self._replicas(res)
        try:
            results = self._copy_batch(True, [(buffer, r, size) for r in replicas],
                                       self.config.transfer_timeout_s)
            failed = [(r, err) for r, (ok, err) in zip(replicas, results, strict=True) if not ok]
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
        self._call(Op.PUT_END, client_id=self.client_id, key=key)

    def _copy_batch(self, write: bool, jobs: list[tuple[Any, ReplicaDescriptor, int]],
                    timeout: float) -> list[tuple[bool, str]]:
        """Copy every ``(buffer, replica, size)`` job: same-host shm copies inline
        (see ``_fastpath``), the rest as ONE engine batch. Returns ``(ok, error)``
        per job. Writes raise StoreTimeout when the batch overruns ``timeout``;
        reads report the overrunning requests as failed (TIMEOUT)."""
        results: list[tuple[bool, str]] = [(False, "")] * len(jobs)
        via_engine: list[int] = []
        inline = self._inline
        for j, (buf, r, size) in enumerate(jobs):
            desc = self._known.get(r.segment_id) if inline is not None else None
            if inline is not None and inline.eligible(desc, size):
                arr = host_array(buf)
                if arr is not None and arr.size >= size and (write or arr.flags.writeable):
                    try:
                        assert desc is not None
                        if write:
                            inline.write(desc, r.offset, arr[:size])
                        else:
                            inline.read(desc, r.offset, arr[:size])
                        results[j] = (True, "")
                        continue
                    except Exception as exc:  # fall back to the engine's transports
                        log.debug("inline shm %s of %s failed: %s",
                                  "write" if write else "read", r.segment_id, exc)
            via_engine.append(j)
        if via_engine:
            make = self._write_req if write else self._read_req
            reqs = [make(jobs[j][0], jobs[j][1], jobs[j][2]) for j in via_engine]
            if write:
                statuses = self._transfer(reqs, timeout)
            elif all(self._is_local_file(jobs[j][1].segment_id) for j in via_engine):
                statuses = self._read_local_files(reqs, timeout)
            else:
                statuses = self._run(reqs, timeout)
            for j, st in zip(via_engine, statuses, strict=True):
                results[j] = (bool(st.ok), "" if st.ok else ("; ".join(st.errors)
                                                              or st.code.name))
        return results

    def _is_local_file(self, seg_id: str) -> bool:
        desc = self._known.get(seg_id)
        return desc is not None and desc.kind == SegmentKind.FILE and desc.host_id == self.host_id

    def _read_local_files(self, reqs: list[Any], timeout: float) -> list[Any]:
        """Reads of this host's file segments: preadv on this thread (no hop
        to an engine worker, ~0.1-0.2 ms per get on a busy host; there is no
        peer whose death a worker would have to wait out)."""
        try:
            return self._transfer(reqs, timeout)
        except StoreError as exc:
            t = self._transfer_mod
            return [t.RequestStatus(t.RequestState.FAILED, None, exc.code, [str(exc)])
                    for _ in reqs]

    def _write_req(self, buffer: Any, r: ReplicaDescriptor, size: int) -> Any:
        t = self._transfer_mod
        return t.TransferRequest(t.TransferOp.WRITE, buffer, r.segment_id, r.offset, size,
                                 capability=r.capability)

    def _read_req(self, buffer: Any, r: ReplicaDescriptor, size: int) -> Any:
        t = self._transfer_mod
        return t.TransferRequest(t.TransferOp.READ, buffer, r.segment_id, r.offset, size,
                                 capability=r.capability)

    def _revoke(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            if len(keys) == 1:
                self._call(Op.PUT_REVOKE, client_id=self.client_id, key=keys[0])
            else:
                self._call(Op.BATCH_PUT_REVOKE, client_id=self.client_id, keys=keys)
        except StoreError as exc:
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
                       config: ReplicateConfig | None = None) -> list[ErrorCode]:
        """Zero-copy :meth:`put_batch` from host or GPU buffers. Same result contract."""
        self._check_open()
        if len(keys) != len(buffers):
            raise StoreError(f"{len(keys)} keys but {len(buffers)} buffers",
                             ErrorCode.INVALID_PARAMS)
        n = len(keys)
        codes: list[ErrorCode] = [ErrorCode.OK] * n
        if n == 0:
            return codes
        args = self._put_args(config)
        items: list[dict[str, Any]] = []
        idx: list[int] = []  # item position -> key index
        sizes = [0] * n
        seen: set[str] = set()
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            try:
                self._valid_key(key)
            except StoreError:
                codes[i] = ErrorCode.INVALID_KEY
                continue
            if key in seen:  # a second put of the same key in one batch
                codes[i] = ErrorCode.OBJECT_ALREADY_EXISTS
                continue
            size = buffer_nbytes(buf)
            if size <= 0:
                codes[i] = ErrorCode.INVALID_PARAMS
                continue
            seen.add(key)
            sizes[i] = size
            item = {"key": key, "size": size, **args}
            if self._checksum_algo is not None:
                item["checksum"] = self._checksum(buf)
            items.append(item)
            idx.append(i)
        if not items:
            return codes
        res = self._call(Op.BATCH_PUT_START, client_id=self.client_id, items=items)
        self._learn_segments(res.get("segments"))
        jobs: list[tuple[Any, ReplicaDescriptor, int]] = []
        owner: list[int] = []  # job -> key index
        for pos, (code, value) in enumerate(res.get("results", [])):
            i = idx[pos]
            if code != ErrorCode.OK:
                codes[i] = self._code(code)
                continue
            for r in self._replicas(value):
                jobs.append((buffers[i], r, sizes[i]))
                owner.append(i)
        ok_keys = [keys[i] for i in idx if codes[i] == ErrorCode.OK]
        try:
            results = self._copy_batch(True, jobs, self.config.transfer_timeout_s)
        except BaseException:
            self._revoke(ok_keys)
            raise
        for (_b, r, _s), i, (ok, _err) in zip(jobs, owner, results, strict=True):
            if not ok:
                codes[i] = ErrorCode.TRANSFER_FAIL
                self._forget_segment(r.segment_id)
        done = [keys[i] for i in idx if codes[i] == ErrorCode.OK]
        failed = [keys[i] for i in idx if codes[i] == ErrorCode.TRANSFER_FAIL]
        self._revoke(failed)
        if done:
            end = self._call(Op.BATCH_PUT_END, client_id=self.client_id, keys=done)
            for key, (code, _v) in zip(done, end.get("results", []), strict=False):
                if code != ErrorCode.OK:
                    codes[keys.index(key)] = self._code(code)
        return codes

    @staticmethod
    def _code(code: Any) -> ErrorCode:
        try:
            return ErrorCode(int(code))
        except ValueError:
            return ErrorCode.INTERNAL_ERROR

    # ------------------------------------------------------------------ get

    def _plan(self, value: dict[str, Any], t0: float, default_ttl_ms: Any) -> _ReadPlan:
        ttl_ms = value.get("lease_ttl_ms", default_ttl_ms)
        deadline = t0 + float(ttl_ms) / 1000.0 if ttl_ms else float("inf")
        replicas = [r for r in self._replicas(value) if r.status == ReplicaStatus.COMPLETE]
        replicas.sort(key=lambda r: self._rank(r.segment_id))
        checksum = value.get("checksum")
        return _ReadPlan(int(value["size"]), checksum if checksum else None, deadline, replicas)

    def _locate(self, key: str) -> _ReadPlan:
        t0 = time.monotonic()  # the lease starts no earlier than our request
        res = self._call(Op.GET_REPLICA_LIST, key=key)
        self._learn_segments(res.get("segments"))
        return self._plan(res, t0, None)

    def _read(self, key: str, plan: _ReadPlan, buffer: Any) -> int:
        """Read ``plan.size`` bytes into ``buffer``: nearest replica first, then the rest."""
        if not plan.replicas:
            raise error_for_code(ErrorCode.OBJECT_NOT_FOUND, f"{key!r} has no complete replica")
        errors: list[str] = []
        n = len(plan.replicas)
        for idx, r in enumerate(plan.replicas):
            remaining = plan.deadline - time.monotonic()
            if remaining <= 0:
                raise LeaseExpired(f"read lease of {key!r} expired before its data was read")
            # leave the replicas after this one a share of the lease: a dead
            # peer must not use up all of it
            budget = min(self.config.transfer_timeout_s, remaining / (n - idx))
            ((ok, err),) = self._copy_batch(False, [(buffer, r, plan.size)], budget)
            if ok:
                if time.monotonic() > plan.deadline:
                    raise LeaseExpired(f"read of {key!r} ended after its lease; bytes discarded")
                self._verify(key, plan, buffer)
                return plan.size
            errors.append(f"{r.segment_id}: {err}")
            self._forget_segment(r.segment_id)
        if time.monotonic() >= plan.deadline:
            raise LeaseExpired(f"read lease of {key!r} expired; replicas failed: "
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
        if plan.checksum is None or not self.config.verify_checksum:
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
        failed), ChecksumMismatch, MasterUnreachable, StoreTimeout.
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
        self._read(key, plan, target)
        return out

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the value of ``key`` into ``buffer`` (host or GPU, raw or a
        registered BufferHandle); return the number of bytes read.

        Raises BufferTooSmall (nothing is read) and the errors of :meth:`get`.
        """
        self._check_open()
        self._valid_key(key)
        plan = self._locate(key)
        cap = buffer_nbytes(buffer)
        if cap < plan.size:
            raise BufferTooSmall(f"{key!r} is {plan.size} bytes; buffer holds {cap}")
        return self._read(key, plan, buffer)

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
            if buffer_nbytes(buffers[i]) < size:
                return None
            return buffers[i]

        return self._batch_read(keys, target)

    def _batch_read(self, keys: Sequence[str], target: Callable[[int, int], Any],
                    outs: dict[int, bytes] | None = None) -> list[int]:
        """Shared body of the batch reads. ``target(i, size)`` gives key i's
        buffer (None: too small) or ``_LAZY_BYTES``: produce a new ``bytes`` into
        ``outs[i]`` (inline shm reads copy straight into it)."""
        self._check_open()
        n = len(keys)
        results: list[int] = [int(ErrorCode.INTERNAL_ERROR)] * n
        if n == 0:
            return results
        valid: list[int] = []
        for i, key in enumerate(keys):
            try:
                self._valid_key(key)
                valid.append(i)
            except StoreError:
                results[i] = int(ErrorCode.INVALID_KEY)
        if not valid:
            return results
        t0 = time.monotonic()
        res = self._call(Op.BATCH_GET_REPLICA_LIST, keys=[keys[i] for i in valid])
        self._learn_segments(res.get("segments"))
        default_ttl = res.get("lease_ttl_ms")
        plans: dict[int, _ReadPlan] = {}
        bufs: dict[int, Any] = {}
        for i, (code, value) in zip(valid, res.get("results", []), strict=False):
            if code != ErrorCode.OK:
                results[i] = int(self._code(code))
                continue
            plan = self._plan(value, t0, default_ttl)
            if not plan.replicas:
                results[i] = int(ErrorCode.OBJECT_NOT_FOUND)
                continue
            buf = target(i, plan.size)
            if buf is None:
                results[i] = int(ErrorCode.BUFFER_OVERFLOW)
                continue
            plans[i] = plan
            bufs[i] = buf
        # Round k reads every pending key from its k-th nearest replica: the
        # common case is one round, i.e. one transfer batch for the whole call.
        pending = list(plans)
        attempt = 0
        while pending:
            now = time.monotonic()
            jobs: list[tuple[Any, ReplicaDescriptor, int]] = []
            owners: list[int] = []
            for i in pending:
                plan = plans[i]
                if plan.deadline <= now:
                    results[i] = int(ErrorCode.LEASE_EXPIRED)
                    continue
                if attempt >= len(plan.replicas):
                    results[i] = int(ErrorCode.TRANSFER_FAIL)
                    continue
                r = plan.replicas[attempt]
                if bufs[i] is _LAZY_BYTES:
                    assert outs is not None
                    fast = self._read_inline_bytes(_ReadPlan(plan.size, None, plan.deadline,
                                                             [r]))
                    if fast is not None:
                        outs[i] = fast
                        bufs[i] = fast
                        results[i] = self._finish_read(keys[i], plan, fast)
                        continue
                    out, bufs[i] = alloc_bytes(plan.size)
                    outs[i] = out
                jobs.append((bufs[i], r, plan.size))
                owners.append(i)
            if not jobs:
                break
            lease_left = min(plans[i].deadline for i in owners) - now
            left = max(len(plans[i].replicas) - attempt for i in owners)
            timeout = max(0.001, min(self.config.transfer_timeout_s, lease_left / left))
            copied = self._copy_batch(False, jobs, timeout)
            pending = []
            for (buf, r, _s), i, (ok, _err) in zip(jobs, owners, copied, strict=True):
                if not ok:
                    self._forget_segment(r.segment_id)
                    pending.append(i)
                else:
                    results[i] = self._finish_read(keys[i], plans[i], buf)
            attempt += 1
        return results

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
                return self._engine.register_buffer(buffer, device=device)
            return self._engine.register_buffer(buffer)
        except KVPoolError as exc:
            raise error_for_code(exc.code, str(exc)) from exc

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
            return bool(self._call(Op.EXIST, key=key).get("exists"))
        except ObjectNotFound:
            return False

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` for many keys in one RPC, in input order ([] for [])."""
        self._check_open()
        if not keys:
            return []
        for k in keys:
            self._valid_key(k)
        res = self._call(Op.BATCH_EXIST, keys=list(keys))
        out: list[bool] = []
        for code, value in res.get("results", []):
            if code != ErrorCode.OK:
                out.append(False)
            elif isinstance(value, dict):
                out.append(bool(value.get("exists")))
            else:
                out.append(bool(value))
        return out

    def get_size(self, key: str) -> int:
        """Size in bytes of ``key``'s value (ObjectNotFound if missing)."""
        self._valid_key(key)
        return int(self._call(Op.GET_SIZE, key=key)["size"])

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``. A leased object raises StoreError(OBJECT_HAS_LEASE)
        unless ``force``; a missing one raises ObjectNotFound."""
        self._valid_key(key)
        self._call(Op.REMOVE, key=key, force=bool(force))

    def remove_all(self, force: bool = False) -> int:
        """Remove every (unleased, or all with ``force``) object; return the count."""
        return int(self._call(Op.REMOVE_ALL, force=bool(force)).get("removed", 0))

    def replica_segments(self, key: str) -> list[str]:
        """Segment ids holding a complete replica of ``key``, nearest first
        (grants a read lease, like exists)."""
        self._valid_key(key)
        return [r.segment_id for r in self._locate(key).replicas]

    def stats(self) -> dict[str, Any]:
        """The master's STATS (uptime, objects, bytes used/capacity, ...)."""
        return self._call(Op.STATS)

    def list_segments(self) -> list[dict[str, Any]]:
        """The master's LIST_SEGMENTS: every mounted segment with used/capacity."""
        return list(self._call(Op.LIST_SEGMENTS).get("segments", []))

    def is_gpu(self, buffer: Any) -> bool:
        """Whether ``buffer`` is device memory (checksums skip those)."""
        return is_gpu_buffer(buffer)

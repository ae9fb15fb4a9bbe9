"""The segment host: the memory and disk a client process contributes to the pool.

A :class:`SegmentHost` belongs to one :class:`kvpool.store.Client` and does
everything that is about *owning* segments rather than moving data:

- creates the shared-memory segment (``memory_size``) and the SSD-tier file
  segment (``disk_dir``/``disk_size``) and hands them to the transfer engine;
- mounts them with the master;
- pings the master every ``ping_interval_s`` (liveness) and re-mounts the
  segments when the master asks (e.g. after a master restart);
- runs the SSD tier's copy tasks that arrive in PING replies
  (:class:`kvpool.store.tier_tasks.TierTaskRunner`);
- keeps a guard process (:mod:`kvpool.store.guard`) that heartbeats while
  this process is stalled and frees the segments if it dies, and removes
  segments orphaned on this host by dead processes (the janitor:
  :meth:`reap_orphans`);
- unmounts and releases all of it on :meth:`close`.

Every client has one, also a pure client (no segments): its pings keep the
client known to the master, so its in-flight puts are not revoked. Nothing
here holds a strong reference to the Client (its threads reach it through a
weak reference), so a Client dropped without ``close()`` is collected and
its finalizer releases everything.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    PING_MAX_WAIT_S,
    ListSegments,
    MountSegment,
    Ping,
    SegmentDescriptor,
    SegmentKind,
    UnmountSegment,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from kvpool.store.config import ClientConfig
from kvpool.store.errors import StoreError, error_for_code
from kvpool.store.guard import Guard, GuardSpec

__all__ = ["SegmentHost"]

log = logging.getLogger(__name__)

_TIER_POLL_S = 0.1  # ping period while tier tasks keep coming
_TIER_BUSY_S = 5.0  # ... for this long after the last reply that carried tasks
# a held PING unanswered this long after its wait is taken as lost (its master
# restarted, say): the node asks again at once rather than after rpc_timeout_s
_LONG_POLL_LATE_S = 0.5
_GUARD_RESPAWN_S = 10.0  # a guard that died is replaced at most this often
_GUARD_READY_S = 30.0  # ... as is one that has not answered `ready` by then


class SegmentHost:
    """Segments one client owns, their mount, liveness and release (module docstring).

    ``new_master()`` makes a master RPC stub. The descriptors of the segments
    it owns are the engine's segment registry's (``descs``). Lifecycle:
    :meth:`create_segments` (optional),
    :meth:`start`, then :meth:`stop`, :meth:`unmount`, :meth:`detach`,
    :meth:`release_segments`, :meth:`close_stubs` (the client's close).
    """

    def __init__(self, config: ClientConfig, client_id: str, host_id: str,
                 new_master: Callable[..., MasterClient]) -> None:
        self.config = config
        self.client_id = client_id
        self.host_id = host_id
        self.pid = os.getpid()  # a forked child's copy releases nothing of ours
        self._new_master = new_master
        self.master: MasterClient | None = None  # mounts and unmounts
        self.ping_master: MasterClient | None = None  # the ping thread's own stub
        self.engine: Any = None
        self.segments: list[Any] = []  # MemorySegment / FileSegment we own
        self.tier_runner: Any = None  # store.tier_tasks.TierTaskRunner (segment owners)
        self._stop = threading.Event()
        self._wake = threading.Event()  # ping now (the tier runner drained its tasks)
        self._ping_thread: threading.Thread | None = None
        self.remounts = 0
        self.guard: Guard | None = None
        self._guard_spawned_at = 0.0
        self.guard_respawns = 0
        self.orphans_reaped = 0

    # ------------------------------------------------------------------ queries

    @property
    def descs(self) -> dict[str, SegmentDescriptor]:
        """The descriptors of the segments this client owns, as published."""
        return {} if self.engine is None else self.engine.registry.own()  # type: ignore[no-any-return]

    @property
    def segment_ids(self) -> list[str]:
        return list(self.descs)

    @property
    def shm_names(self) -> list[str]:
        return [d.name for d in self.descs.values() if d.kind == SegmentKind.MEMORY]

    # ------------------------------------------------------------------ setup

    def check_master(self) -> None:
        """Fail fast (MasterRPCError) when the master does not answer a PING."""
        if self.ping_master is None:
            # ZeroMQ even on the master's host: the master holds long-polling
            # PINGs only there (kvpool.master.parked)
            self.ping_master = self._new_master(local="off")
        self.ping_master.call(Ping(self.client_id))

    def create_segments(self, engine: Any, base_id: str) -> None:
        """Create the memory and file segments the config asks for and add
        them to ``engine``. A segment-owning client first starts its guard
        process (its start-up overlaps the segment's pre-fault) and removes
        orphans on this host."""
        import kvpool.transfer as transfer

        cfg = self.config
        self.engine = engine
        owns = cfg.memory_size > 0 or bool(cfg.disk_dir and cfg.disk_size > 0)
        if owns and cfg.guard:
            self._spawn_guard()
        if cfg.memory_size > 0:
            self.reap_orphans()
            seg = transfer.MemorySegment.create(base_id, cfg.memory_size, prefault=cfg.prefault)
            self.segments.append(seg)
            engine.add_local_segment(seg)  # published with the bulk port, ahead
            self._start_tier_runner()
        self._create_file_segments(base_id)

    def _create_file_segments(self, base_id: str) -> None:
        """Create or reopen the SSD-tier FILE segment (``disk_dir``/``disk_size``).

        An existing segment file in ``disk_dir`` is reopened (warm restart:
        its id comes from the file header, so the master re-adopts the objects
        recorded in it); a file of another size starts the tier afresh with a
        warning (:meth:`FileSegment.create`); a foreign or truncated file is
        refused with ``SEGMENT_MISMATCH`` and left untouched.
        """
        cfg = self.config
        if not cfg.disk_dir or cfg.disk_size <= 0:
            return
        from kvpool.transfer.file_segment import FileSegment

        seg = FileSegment.create(f"{base_id}:disk", cfg.disk_dir, cfg.disk_size)
        self.segments.append(seg)
        self.engine.add_local_segment(seg)
        if self.tier_runner is None:
            self._start_tier_runner()

    def _start_tier_runner(self) -> None:
        """The node side of the SSD tier: run the copy tasks (offload,
        promotion) the master hands out in PING replies."""
        from kvpool.store.tier_tasks import TierTaskRunner

        self.tier_runner = TierTaskRunner(
            self.engine, self._new_master(),
            self.client_id,
            transfer_timeout_s=self.config.transfer_timeout_s,
            on_drained=self._wake.set)  # fetch the next tasks without waiting a ping interval

    def start(self, master: MasterClient) -> None:
        """Mount every segment through ``master``, then start the ping thread."""
        self.master = master
        for desc in self.descs.values():
            self._mount(desc)
        for seg in self.segments:
            replaced = getattr(seg, "replaced", None)
            if replaced:
                self._unmount_replaced(master, replaced)
        self._start_guard()
        self._ping_thread = threading.Thread(
            target=self._ping_loop, name=f"kvpool-ping-{self.client_id[:6]}", daemon=True
        )
        self._ping_thread.start()

    def _mount(self, desc: SegmentDescriptor) -> None:
        assert self.master is not None
        try:
            res = self.master.call(MountSegment(self.client_id, desc))
        except MasterRPCError as exc:
            if exc.code == ErrorCode.SEGMENT_ALREADY_EXISTS:
                return  # already mounted by us (a remount racing a ping)
            raise error_for_code(exc.code, str(exc)) from exc
        key = res.capability_key
        if key and self.engine is not None:
            # our transfer server now refuses any READ/WRITE of this segment
            # without a capability the master signed with this key
            self.engine.set_capability_key(desc.segment_id, bytes(key))

    # ------------------------------------------------------------------ guard, janitor

    def _spawn_guard(self) -> None:
        self._guard_spawned_at = time.monotonic()
        try:
            self.guard = Guard.spawn()
        except OSError as exc:
            log.warning("no guard process (%s): a stall longer than the master's "
                        "client_ttl marks this client suspect, and a crash leaves its "
                        "segments to the janitor", exc)

    def _start_guard(self) -> None:
        """Hand the guard its spec (it answers ``ready`` in the background)."""
        guard = self.guard
        if guard is None:
            return
        cfg = self.config
        spec = GuardSpec(
            parent_pid=self.pid, client_id=self.client_id,
            master_address=cfg.master_address, rpc_timeout_s=cfg.rpc_timeout_s,
            interval_s=cfg.ping_interval_s,
            shm={d.segment_id: d.name for d in self.descs.values()
                 if d.kind == SegmentKind.MEMORY},
            curve=dataclasses.asdict(cfg.curve),
            curve_active=cfg.curve.active(_policy(cfg.master_address)),
            log_level=logging.getLogger("kvpool").getEffectiveLevel(),
        )
        try:
            guard.start(spec)
        except OSError as exc:
            log.warning("guard process failed to start (%s); carrying on without it", exc)
            self._drop_guard()

    def _drop_guard(self) -> None:
        if self.guard is not None:
            self.guard.close(timeout_s=0.5)
            self.guard = None

    def _check_guard(self) -> None:
        """The ping thread: note the guard's answer; replace a guard that died
        (killed, OOM) or never answered."""
        guard = self.guard
        if guard is None or self._stop.is_set():
            return
        try:
            if guard.ready():
                if guard.alive():
                    return
            elif time.monotonic() - guard.spawned_at < _GUARD_READY_S:
                return
        except OSError as exc:
            log.debug("guard %d: %s", guard.pid, exc)
        if time.monotonic() - self._guard_spawned_at < _GUARD_RESPAWN_S:
            return
        log.warning("guard process %d is gone or silent (exit %s); starting a new one",
                    guard.pid, guard.proc.poll())
        self._drop_guard()
        self._spawn_guard()
        self._start_guard()
        self.guard_respawns += 1

    def close_guard(self) -> None:
        """After the segments are released: the guard has nothing left to do."""
        if self.guard is not None:
            self.guard.close()
            self.guard = None

    @staticmethod
    def _unmount_gone(master: MasterClient, gone: Callable[[SegmentDescriptor], bool],
                      why: str) -> None:
        """Unmount at the master every segment ``gone`` picks, whichever client
        mounted it (its memory or file is gone: its objects go now); raises
        MasterRPCError."""
        for info in master.call(ListSegments()).segments:
            d = info.descriptor
            if gone(d):
                master.call(UnmountSegment(d.client_id, d.segment_id))
                log.warning("unmounted %s of client %s: %s", d.segment_id, d.client_id[:8], why)

    def _unmount_replaced(self, master: MasterClient, segment_id: str) -> None:
        """The SSD tier started afresh at another size: unmount the segment of
        the file it replaced, so its objects are misses now rather than reads
        of a file that is gone (its owner was this node's earlier run)."""
        try:
            self._unmount_gone(
                master, lambda d: d.segment_id == segment_id and d.kind == SegmentKind.FILE,
                "its file was replaced by a tier of another size")
        except MasterRPCError as exc:
            log.warning("could not unmount the replaced disk segment %s (%s); the master "
                        "drops it when its owner's grace ends", segment_id, exc)

    def reap_orphans(self) -> list[str]:
        """The janitor: remove this host's ``/dev/shm`` segments whose owner
        died (:func:`kvpool.transfer.segment.reap_orphaned_shm`) and unmount
        them at the master (owner verified dead: their objects go now).
        Returns the shm names removed."""
        from kvpool.transfer.segment import reap_orphaned_shm

        names = set(reap_orphaned_shm())
        if not names:
            return []
        self.orphans_reaped += len(names)
        master = self.master or self.ping_master
        if master is not None:
            try:
                self._unmount_gone(
                    master, lambda d: d.name in names and d.kind == SegmentKind.MEMORY,
                    "its owner died on this host")
            except MasterRPCError as exc:
                log.info("janitor: the master drops the orphans' segments itself (%s)", exc)
        return sorted(names)

    # ------------------------------------------------------------------ liveness

    def _ping_loop(self) -> None:
        """Ping every ``ping_interval_s``; re-mount our segments when the master asks.

        A node running tier tasks long-polls: its PING asks the master to hold
        it up to the ping interval (``wait_ms``, :mod:`kvpool.master.parked`)
        and to answer as soon as a task for this node is queued; after a held
        PING, or one that carried tasks, it pings again at once. A master that
        answers at once with nothing (one that predates ``wait_ms``, or one
        that may not hold it) is pinged at the interval, every _TIER_POLL_S
        while tasks keep coming."""
        assert self.ping_master is not None
        base_interval = self.config.ping_interval_s
        tier_busy_until = 0.0
        # ping at once: the last PING was held, or carried tasks (a tier node
        # starts its long poll at once)
        again = self.tier_runner is not None
        while True:
            if not again:
                interval = base_interval
                if time.monotonic() < tier_busy_until:
                    interval = min(base_interval, _TIER_POLL_S)
                self._wake.wait(interval)
                self._wake.clear()
            again = False
            if self._stop.is_set():
                break
            self._check_guard()
            wait_s = min(base_interval, PING_MAX_WAIT_S) if self.tier_runner is not None else 0.0
            try:
                sent = time.monotonic()
                res = self.ping_master.call(
                    Ping(self.client_id, wait_ms=int(wait_s * 1000)),
                    timeout_s=wait_s + min(self.config.rpc_timeout_s, _LONG_POLL_LATE_S)
                    if wait_s else None)
                # held (answered late) by a master that long-polls
                again = wait_s > 0 and time.monotonic() - sent >= wait_s / 2
                if res.epoch and self.engine is not None:
                    # fencing: grants of older leader terms are refused from now on
                    self.engine.observe_master_epoch(res.epoch)
                if res.tasks and self.tier_runner is not None:
                    self.tier_runner.submit(res.tasks, res.segments, res.caps)
                    tier_busy_until = time.monotonic() + _TIER_BUSY_S
                    again = True
                remount = res.remount
                if not remount and self.descs:
                    # the master knows us but lost a segment of ours: mount it again
                    remount = not set(self.descs) <= set(res.segment_ids)
            except MasterRPCError as exc:
                if exc.code != ErrorCode.CLIENT_NOT_FOUND:
                    log.debug("ping failed: %s", exc)
                    # a held PING lost (e.g. with its master): ask again at once
                    # (each attempt waits out its timeout: no spin)
                    again = wait_s > 0 and exc.code == ErrorCode.RPC_TIMEOUT
                    continue
                remount = True
            if remount and not self._stop.is_set():
                self._remount()

    def _remount(self) -> None:
        log.info("master asked client %s to re-mount %d segment(s)",
                 self.client_id[:8], len(self.descs))
        for desc in list(self.descs.values()):
            try:
                self._mount(desc)
            except StoreError as exc:
                log.warning("re-mount of %s failed: %s", desc.segment_id, exc)
                return
        self.remounts += 1

    # ------------------------------------------------------------------ release

    def stop(self) -> None:
        """Stop the ping thread and the tier runner (segments stay mounted)."""
        self._stop.set()
        self._wake.set()
        runner = self.tier_runner
        if runner is not None:
            runner.close()
            if self._ping_thread is not None and self._ping_thread.is_alive():
                # a PING that does not wait answers our held one (the runner's
                # stub is idle now): the thread ends without waiting it out
                try:
                    runner.master.call(Ping(self.client_id), timeout_s=1.0)
                except MasterRPCError as exc:
                    log.debug("releasing the held ping: %s", exc)
        if self._ping_thread is not None:
            self._ping_thread.join(timeout=self.config.rpc_timeout_s + PING_MAX_WAIT_S + 1)
        if runner is not None:
            runner.master.close()

    def unmount(self) -> None:
        """Unmount the memory segments at the master (best effort)."""
        if self.master is None:
            return
        for seg_id, desc in self.descs.items():
            if desc.kind == SegmentKind.FILE:
                # the SSD tier outlives this process: the master keeps the
                # segment awaiting us and a restart on the same disk dir
                # re-adopts its objects (warm restart)
                continue
            try:
                self.master.call(UnmountSegment(self.client_id, seg_id),
                                 timeout_s=min(2.0, self.config.rpc_timeout_s))
            except (MasterRPCError, KVPoolError) as exc:
                log.debug("unmount %s: %s", seg_id, exc)

    def detach(self) -> None:
        """Remove our segments from the transfer engine (no more serving)."""
        if self.engine is None:
            return
        for seg_id in list(self.descs):
            try:
                self.engine.remove_local_segment(seg_id)
            except Exception as exc:  # releasing must go on whatever one step raises
                log.debug("remove_local_segment %s: %s", seg_id, exc)

    def release_segments(self) -> None:
        """Close (unmap, unlink) the local segments."""
        for seg in self.segments:
            try:
                seg.close()
            except Exception as exc:
                log.warning("closing segment: %s", exc)
        self.segments.clear()

    def close_stubs(self) -> None:
        if self.ping_master is not None:
            self.ping_master.close()

    def owned_here(self) -> bool:
        """False in a forked child: the parent owns the segments and the guard."""
        return os.getpid() == self.pid


def _policy(address: str) -> str:
    from kvpool.core.etcd import policy_address

    addr = policy_address(address)
    return addr if "://" in addr else f"tcp://{addr}"

"""Node side of the SSD tier: execute the master's tier tasks.

The master hands tier tasks (offload memory -> disk, promote disk -> memory;
see :mod:`kvpool.master.tiering`) to the node that owns the source replica,
in its PING replies. :class:`TierTaskRunner` runs them on one background
thread: the source bytes are local to this process, so each task is one
transfer-engine WRITE of the source range into the destination replica
(``posix`` when the destination is a file on this host, ``shm`` for memory
here, ``tcp`` for another host), straight from the shared-memory segment's
mapping (no copy) or, for a file source, from one bounce buffer. A
destination owned by this process is written in place. Each task is reported
with ``TIER_TASK_DONE`` and counted by kind and result (the node's metrics).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentDescriptor, TierTaskDone
from kvpool.core.protocol import TierTask as WireTask
from kvpool.core.rpc_client import MasterClient, MasterRPCError

__all__ = ["TIER_TASK_KINDS", "TierTask", "TierTaskRunner"]

log = logging.getLogger(__name__)

#: a tier task's ``kind`` (the master's ``TaskKind``) -> its metric label
TIER_TASK_KINDS = {1: "offload", 2: "promote", 3: "copy", 4: "replica_copy",
                   5: "replica_move"}


@dataclass(slots=True)
class TierTask:
    """A tier task as this node runs it: the master's task (``wire``), the
    WRITE capability on the destination that it points at, and when it came."""

    wire: WireTask
    capability: bytes = b""
    received: float = 0.0  # monotonic time this node got it

    @classmethod
    def from_reply(cls, w: WireTask, caps: list[bytes]) -> TierTask:
        """A task of a PING reply (``caps``: the reply's capability tokens)."""
        return cls(w, caps[w.cap] if 0 <= w.cap < len(caps) else b"", time.monotonic())

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> TierTask:
        """A task from its map form (``master.tiering.CopyTask.to_wire`` plus ``cap``)."""
        try:
            wire = WireTask(int(w["id"]), int(w["kind"]), str(w["key"]), int(w["size"]),
                            str(w["src"][0]), int(w["src"][1]), str(w["dst"][0]),
                            int(w["dst"][1]), int(w.get("ttl_ms") or 0))
            return cls(wire, bytes(w.get("cap") or b""), time.monotonic())
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise KVPoolError(f"bad tier task {w!r}: {exc}", ErrorCode.INVALID_PARAMS) from exc


class TierTaskRunner:
    """Runs tier tasks for one client (``client_id``) on a background thread.

    ``engine`` is the client's TransferEngine (its own segments added);
    ``master`` a MasterClient used only by this runner's thread.
    ``learn_segment(desc)`` registers a segment descriptor with the engine
    (the store's cache); ``transfer_timeout_s`` bounds each copy;
    ``on_drained()`` is called when the queue runs empty (the client then
    pings at once to fetch further tasks).
    """

    def __init__(self, engine: Any, master: MasterClient, client_id: str,
                 learn_segment: Callable[[SegmentDescriptor], None] | None = None,
                 transfer_timeout_s: float = 30.0,
                 on_drained: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.master = master
        self.client_id = client_id
        self.learn = learn_segment or engine.add_peer_segment
        self.timeout_s = transfer_timeout_s
        self.on_drained = on_drained
        self._q: queue.Queue[tuple[TierTask, dict[str, SegmentDescriptor]] | None] = \
            queue.Queue()
        self.done = 0
        self.failed = 0
        #: (kind label, ok) -> tasks reported; kind label -> bytes copied by tasks done
        self.by_kind: dict[tuple[str, bool], int] = {}
        self.bytes_by_kind: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"kvpool-tier-{client_id[:6]}",
                                        daemon=True)
        self._thread.start()

    def submit(self, tasks: list[WireTask] | list[dict[str, Any]],
               segments: dict[str, SegmentDescriptor] | dict[str, Any] | None = None,
               caps: list[bytes] | None = None) -> int:
        """Queue the tasks of one PING reply (typed, with the reply's ``caps``;
        or in map form); returns how many were accepted."""
        n = 0
        segs: dict[str, SegmentDescriptor] = {}
        try:
            for sid, d in (segments or {}).items():
                segs[sid] = d if isinstance(d, SegmentDescriptor) \
                    else SegmentDescriptor.from_wire(d)
        except KVPoolError as exc:
            log.warning("ignoring tier task segments: %s", exc)
        for w in tasks or ():
            try:
                task = TierTask.from_reply(w, caps or []) if isinstance(w, WireTask) \
                    else TierTask.from_wire(w)
                self._q.put((task, segs))
                n += 1
            except KVPoolError as exc:
                log.warning("ignoring tier task: %s", exc)
        return n

    def pending(self) -> int:
        return self._q.qsize()

    def _run(self) -> None:
        while True:
            entry = self._q.get()
            if entry is None:
                return
            task, segs = entry
            ok, err = True, ""
            try:
                timeout = self.timeout_s
                if task.wire.ttl_ms:
                    # start no copy after half the master's timeout: past its
                    # deadline it frees the destination for reuse
                    left = task.received + task.wire.ttl_ms / 2000.0 - time.monotonic()
                    if left <= 0:
                        raise KVPoolError("task arrived too long ago", ErrorCode.TIMEOUT)
                    timeout = min(timeout, left)
                self._execute(task, segs, timeout)
            except Exception as exc:  # report every failure to the master
                ok, err = False, f"{type(exc).__name__}: {exc}"
                log.info("tier task %d (%s) failed: %s", task.wire.id, task.wire.key[:64], err)
            self._report(task, ok, err)
            if self._q.empty() and self.on_drained is not None:
                self.on_drained()  # the master may have more for us: ask now

    def _execute(self, task: TierTask, segs: dict[str, SegmentDescriptor], timeout: float
                 ) -> None:
        engine = self.engine
        t = task.wire
        src = engine.local_segment(t.src_id)
        if src is None:
            raise KVPoolError(f"source segment {t.src_id} is not ours", ErrorCode.SEGMENT_NOT_FOUND)
        dst_local = engine.local_segment(t.dst_id)
        view = src.view()
        if view is not None:
            data: Any = view[t.src_off:t.src_off + t.size]  # shm: no copy
        else:
            buf = np.empty(t.size, np.uint8)
            src.read_into(t.src_off, buf)
            data = buf
        if dst_local is not None:
            dst_local.write_from(t.dst_off, data)  # in place, no transport needed
            return
        desc = segs.get(t.dst_id)
        if desc is not None:
            self.learn(desc)
        from kvpool.transfer import TransferOp, TransferRequest

        st = engine.transfer([TransferRequest(TransferOp.WRITE, data, t.dst_id, t.dst_off,
                                              t.size, capability=task.capability)],
                             timeout=timeout)
        if not st[0].ok:
            raise KVPoolError(f"copy to {t.dst_id} failed: {st[0].errors}", st[0].code)

    def _report(self, t: TierTask, ok: bool, err: str) -> None:
        kind = TIER_TASK_KINDS.get(t.wire.kind, str(t.wire.kind))
        self.by_kind[(kind, ok)] = self.by_kind.get((kind, ok), 0) + 1
        if ok:
            self.done += 1
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + t.wire.size
        else:
            self.failed += 1
        try:
            self.master.call(TierTaskDone(self.client_id, t.wire.id, ok, err[:500]))
        except MasterRPCError as exc:
            # the master times the task out and frees its allocation itself
            log.debug("reporting tier task %d failed: %s", t.wire.id, exc)

    def close(self) -> None:
        """Stop after the current task (queued ones are dropped; the master
        times them out)."""
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._q.put(None)
        self._thread.join(timeout=self.timeout_s + 1)

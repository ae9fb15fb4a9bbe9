"""The master's durability room: journal, snapshots, restore, capability keys.

:class:`Durability` owns everything the master keeps in ``data_dir``:

- restore at start: the newest valid snapshot plus every journal after it
  (:meth:`restore` builds the :class:`Directory`);
- group commit: :meth:`commit` writes one loop iteration's directory
  records with one write (fsync per policy) *before* the loop sends the
  replies of that iteration, then hands the same batch to every commit
  listener, in commit order;
- fuzzy snapshots started on a timer or on request and written in slices
  between iterations (:mod:`kvpool.master.journal`), then compaction;
- the capability keys file (``capability-keys.msgpack``, 0600, fsync'ed).

Without a ``data_dir`` nothing is written, but listeners still see every
batch.

An HA standby journals the replicated stream here too
(:meth:`commit_stream`: the leader's journal frames of the batches'
directory records, as received, plus a position record
(:class:`~kvpool.master.records.StreamPos`) in one write, before its ack) and replaces
the data dir's state at once by a snapshot of a directory it received
whole (:meth:`rebase`). So a
standby, promoted or not, that crashes restarts with the replicated state
and, through :attr:`position`, its place in the leader's log.

The commit seam is where replication hooks in:

- :meth:`add_listener`: ``listener(records, commit_no)`` runs on the loop
  thread after the local commit, before any reply of that iteration leaves.
  It must not raise. :meth:`add_frame_listener`: the same with the bytes the
  journal wrote for them (``listener(records, frames, commit_no)``; encoded
  even without a journal): the HA leader ships these bytes to its standbys
  as they are, which journal them as they are.
- :meth:`set_ack_gate`: ``acked() -> commit_no`` says up to which commit
  replies may leave. With a gate set, the loop holds every reply of an
  iteration (reads too: they may show that iteration's changes) until
  ``acked()`` reaches the commit number current when it was handled, and
  sends held replies in order. Without one (single master) replies leave
  right after the local commit, as before. The gate's optional
  ``replicated() -> commit_no`` (every needed replica holds the commits up to
  it, whether or not acknowledgments may go now) releases, out of order,
  the replies of iterations that changed nothing (reads, refusals): they
  acknowledge no change, so only the state they show must be safe. An HA
  leader past its fencing deadline thus still answers reads and refuses
  writes while a write it took just before the deadline stays unanswered.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpool.core.capability import CapabilitySigner
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory, Segment
from kvpool.master.journal import (
    Journal,
    SnapshotWriter,
    encode_frames,
    iter_journal,
    iter_snapshot,
    list_journals,
    list_snapshots,
)
from kvpool.master.records import DirRecord, Rec, StreamPos
from kvpool.master.stats import LoopStats
from kvpool.master.unloaded import release_heap

__all__ = ["CommitListener", "Durability", "FrameListener", "StreamPosition"]

log = logging.getLogger(__name__)

_KEYS_FILE = "capability-keys.msgpack"


@dataclass
class StreamPosition:
    """Where a standby's journaled state stands in the leader's log."""

    epoch: int
    lsn: int
    history: list[tuple[int, int]]

    def wire(self) -> list[Any]:
        return [self.epoch, self.lsn, [list(h) for h in self.history]]


def _history(raw: Any) -> list[tuple[int, int]]:
    return [(int(e), int(f)) for e, f in raw]


#: ``listener(records, batch)``: the directory records of one group commit, in
#: order, and the commit's sequence number (1, 2, ... per process).
CommitListener = Callable[[Sequence[DirRecord], int], None]
#: ``listener(records, frames, batch)``: as :data:`CommitListener`, with the
#: journal's encoding of the records (batch frames, ``journal.encode_frames``)
FrameListener = Callable[[list[DirRecord], bytes, int], None]


class Durability:
    """Journal + snapshots + keys file of one master (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, loop_stats: LoopStats | None = None) -> None:
        self.cfg = cfg
        self.data_dir = cfg.data_dir
        self.stats = loop_stats or LoopStats()
        self.journal: Journal | None = None
        self._listeners: list[CommitListener] = []
        self._frame_listeners: list[FrameListener] = []
        self._gate: Callable[[], int] | None = None
        self._replicated: Callable[[], int] | None = None
        self.commits = 0  # group commits with records so far (their commit numbers)
        self._snapshot: SnapshotWriter | None = None
        self._snap_requested = False
        self._last_snapshot = time.monotonic()
        #: set by restore: the restored state's position in the leader's log (an
        #: HA standby's journal), None when unknown or when anything else was
        #: journaled after the last position (a leader's records)
        self.position: StreamPosition | None = None
        self._journaled_history: list[tuple[int, int]] | None = None
        if self.data_dir:
            os.makedirs(self.data_dir, exist_ok=True)
            os.chmod(self.data_dir, 0o700)  # journal, snapshots and segment keys are secrets

    # ================================================================ commit
    def add_listener(self, listener: CommitListener) -> None:
        """Call ``listener(records, batch)`` after every group commit (loop thread)."""
        self._listeners.append(listener)

    def add_frame_listener(self, listener: FrameListener) -> None:
        """Call ``listener(records, frames, batch)`` after every group commit
        (loop thread, after the plain listeners); ``records`` is the
        listener's own copy, ``frames`` the bytes the journal wrote."""
        self._frame_listeners.append(listener)

    def set_ack_gate(self, acked: Callable[[], int] | None,
                     replicated: Callable[[], int] | None = None) -> None:
        """Hold replies until ``acked()`` reaches their commit number (None: never
        hold); replies of iterations without records only until ``replicated()``
        does (default: ``acked``)."""
        self._gate = acked
        self._replicated = replicated

    @property
    def gated(self) -> bool:
        return self._gate is not None

    def acked(self) -> int:
        """The highest commit number whose replies may leave."""
        return self._gate() if self._gate is not None else self.commits

    def replicated(self) -> int:
        """The highest commit number whose records every needed replica holds:
        replies that acknowledge no change may leave up to it."""
        return self._replicated() if self._replicated is not None else self.acked()

    def commit(self, records: list[DirRecord]) -> int:
        """Make ``records`` durable (one write, fsync per policy), hand them to
        the listeners, and clear the list; return the current commit number
        (unchanged for an empty list)."""
        if not records:
            return self.commits
        journal = self.journal
        frame_listeners = self._frame_listeners
        # encoded once: the journal and the standbys get the same bytes
        frames = encode_frames(records) if journal is not None or frame_listeners else b""
        if journal is not None:
            journal.append_frames(frames, len(records))
            journal.commit()
            self._journaled_history = None  # a position journaled later restates it
        self.commits += 1
        if self._listeners or frame_listeners:
            batch = list(records)
            for listener in self._listeners:
                listener(batch, self.commits)
            for frame_listener in frame_listeners:
                frame_listener(batch, frames, self.commits)
        records.clear()
        return self.commits

    @property
    def busy(self) -> bool:
        """A snapshot is being written (the loop should not sleep long)."""
        return self._snapshot is not None

    def tick(self, directory: Directory, now: float,
             position: StreamPosition | Callable[[], StreamPosition] | None = None) -> None:
        """Timer work between loop iterations: fsync per policy, one snapshot
        slice, start a snapshot when due or requested (``position``: a
        standby's, for the snapshot's header, or what gives it: asked only
        when a snapshot starts)."""
        journal = self.journal
        if journal is None:
            self._snap_requested = False
            return
        journal.maybe_fsync()
        self._snapshot_step(directory)
        cfg = self.cfg
        written = journal.records_written
        if self._snap_requested or (
                cfg.snapshot_interval_s
                and now - self._last_snapshot >= cfg.snapshot_interval_s
                and written >= cfg.snapshot_min_journal_records) or (
                cfg.snapshot_journal_records and written >= cfg.snapshot_journal_records
                and written >= len(directory.objects) and self._snapshot is None):
            self._snap_requested = False
            self._start_snapshot(directory, position() if callable(position) else position)

    def request_snapshot(self) -> None:
        """Take a snapshot at the next tick."""
        self._snap_requested = True

    # ================================================================ restore
    def restore(self, make_directory: Callable[[], Directory]) -> Directory:
        """The directory as of the newest valid snapshot plus every journal
        after it (a fresh one without ``data_dir``); opens the next journal."""
        d = make_directory()
        data_dir = self.data_dir
        if not data_dir:
            return d
        d.journaling = False
        t0 = time.monotonic()
        snap_seq = 0
        pos: StreamPosition | None = None
        for seq, path in reversed(list_snapshots(data_dir)):
            try:
                header, records = iter_snapshot(path)
                d.replay.bulk_load(list(header["segments"]), records)
                d.tenants.load_live(header.get("tenants"))
                stream = header.get("stream")
                pos = None if stream is None else StreamPosition(
                    int(stream[0]), int(stream[1]), _history(stream[2]))
            except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                log.error("ignoring snapshot %s: %s", path, exc)
                d = make_directory()  # discard what was partly loaded
                d.journaling = False
                pos = None
                continue
            snap_seq = seq
            break
        for name in os.listdir(data_dir):  # leftovers of a crashed snapshot child
            if ".tmp." in name and name.startswith("snapshot-"):
                os.unlink(os.path.join(data_dir, name))
        last_seq = snap_seq
        replayed = 0
        # the history of the last position seen (a position record restates it only
        # when it changed)
        history = list(pos.history) if pos is not None else None
        for seq, path in list_journals(data_dir):
            last_seq = max(last_seq, seq)
            if seq < snap_seq:
                continue
            # frame by frame: one frame's records (a group commit) live at a time
            for journal_records in iter_journal(path, truncate=True):
                run: list[Any] = []  # directory records since the last position
                for rec in journal_records:
                    if type(rec) is list and rec and rec[0] == Rec.STREAM_POS:
                        pos = history = None  # a position record that does not read
                        continue
                    if type(rec) is not StreamPos:
                        run.append(rec)
                        pos = None  # a record after the last position: the position is unknown
                        continue
                    self._replay(d, run, path)
                    if rec.history is not None:
                        history = _history(rec.history)
                    pos = None if history is None else StreamPosition(rec.epoch, rec.lsn,
                                                                      list(history))
                self._replay(d, run, path)
                replayed += len(journal_records)
        self.position = pos
        self._journaled_history = list(pos.history) if pos is not None else None
        limit = self.cfg.snapshot_journal_records
        if limit and replayed >= limit and replayed >= len(d.objects):
            # the next restart would replay it all again: compact at the first tick
            self._snap_requested = True
        d.finish_restore()
        d.journaling = True
        self.stats.restored_objects = len(d.objects)
        self.stats.restore_s = round(time.monotonic() - t0, 3)
        if snap_seq or replayed:
            release_heap()
        self.journal = Journal(data_dir, last_seq + 1, self.cfg.journal_fsync,
                               self.cfg.journal_fsync_interval_ms / 1000.0)
        self.stats.journal_seq = self.journal.seq
        if snap_seq or replayed:
            left = d.objects.unloaded
            log.info("restored %d segments, %d objects (snapshot %d + %d journal records) in %.2fs"
                     "%s%s", len(d.segments), len(d.objects), snap_seq, replayed,
                     time.monotonic() - t0,
                     f"; replicated up to lsn {pos.lsn} (epoch {pos.epoch})" if pos else "",
                     f"; serving while {left.count} of them load" if left is not None else "")
        return d

    @staticmethod
    def _replay(d: Directory, records: list[Any], path: str) -> None:
        """Apply ``records`` (of journal ``path``) and empty the list; a bad
        record is logged and skipped."""
        for rec, exc in d.apply_records(records):
            log.error("journal %s: bad record %r: %s", path, rec[:2], exc)
        records.clear()

    # ================================================================ a standby's stream
    def commit_stream(self, frames: Sequence[bytes], records: int,
                      position: StreamPosition) -> None:
        """Journal a standby's replicated directory records (``frames``: the
        leader's journal frames as received, ``records`` records in all) and
        the position after them: one write (fsync per policy)."""
        journal = self.journal
        if journal is None:
            return
        for i, data in enumerate(frames):
            journal.append_frames(data, records if i == 0 else 0)
        history = position.history
        changed = history != self._journaled_history
        journal.append(StreamPos(position.epoch, position.lsn,
                                 [list(h) for h in history] if changed else None))
        if changed:
            self._journaled_history = list(history)
        journal.commit()

    def rebase(self, directory: Directory, position: StreamPosition) -> bool:
        """Make ``directory`` (a standby's, received whole) the data dir's state:
        a snapshot of it in a new journal seq, written now (the loop waits), then
        the older files go. Until the snapshot is on disk the old state stays
        the restorable one. False (logged) when it could not be written: the
        caller must not journal the stream on top of the old state then."""
        journal = self.journal
        if journal is None or not self.data_dir:
            return False
        self.discard_snapshot()
        t0 = time.monotonic()
        new_seq = journal.seq + 1
        try:
            journal.rotate(new_seq, sync=True)
            writer = SnapshotWriter(self.data_dir, new_seq, directory.segtab.wires(),
                                    directory.objects.key_chunks(), stream=position.wire(),
                                    tenants=directory.tenants.live_records())
            while not writer.step(directory.replay.snapshot_chunk, 1.0):
                pass
            writer.done.wait()
        except OSError as exc:
            log.error("cannot write the replicated state to %s: %s", self.data_dir, exc)
            return False
        if writer.error is not None:
            log.error("cannot write the replicated state to %s: %s", self.data_dir,
                      writer.error)
            return False
        self.stats.journal_seq = new_seq
        self._journaled_history = list(position.history)
        self._last_snapshot = time.monotonic()
        self._compact(new_seq)
        log.info("replicated state written: snapshot %d (%d objects, lsn %d) in %.2fs",
                 new_seq, writer.count, position.lsn, time.monotonic() - t0)
        return True

    def discard_snapshot(self) -> None:
        """Abandon a snapshot in progress (its directory is being replaced)."""
        if self._snapshot is not None:
            self._snapshot.abort()
            self._snapshot = None
            self.stats.snapshot_in_progress = False

    # ================================================================ snapshots
    def _start_snapshot(self, d: Directory, position: StreamPosition | None = None) -> None:
        """Rotate the journal and start a fuzzy snapshot (see journal.py)."""
        if self.journal is None or self._snapshot is not None:
            return
        st = self.stats
        t0 = time.perf_counter()
        c0 = time.thread_time()
        new_seq = self.journal.seq + 1
        old_fd = self.journal.rotate(new_seq, sync=False)
        st.journal_seq = new_seq
        # keys are copied one shard at a time as the snapshot reaches them
        self._snapshot = SnapshotWriter(self.data_dir or ".", new_seq, d.segtab.wires(),
                                        d.objects.key_chunks(), old_fd,
                                        position.wire() if position is not None else None,
                                        d.tenants.live_records())
        st.snapshot_in_progress = True
        st.last_snapshot_pause_ms = (time.perf_counter() - t0) * 1000
        st.last_snapshot_pause_cpu_ms = (time.thread_time() - c0) * 1000
        self._last_snapshot = time.monotonic()
        log.info("snapshot %d started (%d objects, pause %.1f ms)", new_seq,
                 len(d.objects), st.last_snapshot_pause_ms)

    def _snapshot_step(self, d: Directory) -> None:
        snap = self._snapshot
        if snap is None:
            return
        st = self.stats
        t0 = time.perf_counter()
        c0 = time.thread_time()
        snap.step(d.replay.snapshot_chunk, self.cfg.snapshot_slice_ms / 1000.0)
        st.max_snapshot_step_ms = max(st.max_snapshot_step_ms,
                                      (time.perf_counter() - t0) * 1000)
        st.max_snapshot_step_cpu_ms = max(st.max_snapshot_step_cpu_ms,
                                          (time.thread_time() - c0) * 1000)
        if not snap.done.is_set():
            return
        self._snapshot = None
        st.snapshot_in_progress = False
        st.last_snapshot_duration_s = time.monotonic() - snap.started
        if snap.error is not None:
            log.error("snapshot %d failed: %s; journals kept", snap.seq, snap.error)
            return
        st.snapshots += 1
        self._compact(snap.seq)
        log.info("snapshot %d written (%d objects) in %.2fs", snap.seq, snap.count,
                 st.last_snapshot_duration_s)

    def _compact(self, seq: int) -> None:
        """Keep the newest ``snapshot_keep`` snapshots and the journals they need."""
        data_dir = self.data_dir
        assert data_dir
        snaps = list_snapshots(data_dir)
        keep = snaps[-self.cfg.snapshot_keep:]
        for _s, path in snaps[: len(snaps) - len(keep)]:
            os.unlink(path)
        oldest = keep[0][0] if keep else seq
        for s, path in list_journals(data_dir):
            if s < oldest:
                os.unlink(path)

    # ================================================================ capability keys
    def _keys_path(self) -> str | None:
        return os.path.join(self.data_dir, _KEYS_FILE) if self.data_dir else None

    def load_keys(self, signer: CapabilitySigner | None, segments: dict[str, Segment]) -> None:
        """Restore the keys of restored segments."""
        path = self._keys_path()
        if signer is None or path is None or not os.path.exists(path):
            return
        try:
            with open(path, "rb") as f:
                keys = msgpack.unpackb(f.read(), raw=False)
            if type(keys) is not dict:
                raise ValueError("not a map")
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            log.error("ignoring %s: %s (segments get new keys when re-mounted)", path, exc)
            return
        signer.load_keys({k: v for k, v in keys.items()
                          if k in segments and type(v) is bytes})

    def save_keys(self, signer: CapabilitySigner | None) -> None:
        """Write every segment key atomically (mode 0600, fsync'ed): rare
        (new mounts and pruning), so done synchronously."""
        path = self._keys_path()
        if signer is None or path is None:
            return
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, msgpack.packb(signer.keys(), use_bin_type=True))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def prune_keys(self, signer: CapabilitySigner | None, segments: dict[str, Segment]) -> None:
        """Forget the keys of segments the directory no longer has (timer)."""
        if signer is None:
            return
        gone = [sid for sid in signer.keys() if sid not in segments]
        for sid in gone:
            signer.forget(sid)
        if gone:
            try:
                self.save_keys(signer)
            except OSError as exc:
                log.error("cannot write capability keys: %s", exc)

    # ================================================================ close
    def close(self, records: list[DirRecord]) -> None:
        """Flush ``records`` and the journal (fsync), abandon a running snapshot."""
        if self.journal is not None:
            if records:
                self.journal.append_many(records)
                records.clear()
            self.journal.close()
            if self._snapshot is not None:
                self._snapshot.abort()
                self._snapshot = None
                self.stats.snapshot_in_progress = False
            self.journal = None

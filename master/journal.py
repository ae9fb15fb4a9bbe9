"""Durability: an append-only journal and msgpack snapshots in ``data_dir``.

Snapshots are *fuzzy* (as ZooKeeper's): the master rotates to journal
``seq``, then serializes its objects in small time-bounded slices between
requests while it keeps serving and journaling; a writer thread writes the
chunks. Objects changed during the snapshot may be captured in either state,
but every such change is also in journal ``>= seq``, and replaying records
is idempotent (a PUT replaces, a REMOVE of an absent key is a no-op, a
conflicting reservation is skipped and then fixed by the replay), so
snapshot + journals reproduce the exact state. No fork, no stall beyond one
slice (a few ms) at any object count.

Files:
- ``journal-<seq>.log``: frames of ``u32 length | u32 crc32 | msgpack``
  (little endian); a frame holds one record (an array whose first item is
  its int tag: :mod:`kvpool.master.records`) or, as the journal writes
  them, a group commit's records as one list of records (up to
  ``_FRAME_RECORDS``: one encode and one checksum per batch, not per
  record). A torn or corrupt tail is detected on read and
  truncated (a torn batch frame drops its whole group commit; under the
  ``interval`` fsync policy a host crash loses the last interval either way).
- ``snapshot-<seq>.msgpack``: the state as of the *start* of journal ``seq``
  (so restore = newest valid snapshot + journals ``>= seq``). Written to a
  temp file, fsync'ed, renamed, directory fsync'ed. A stream of msgpack
  values: a header map, then (version 2) one *column chunk* per slice of
  keys, ``[2, groups, others]``: ``groups`` one ``[segment_id, keys, sizes,
  flags, checksums, offsets]`` per segment of the slice's objects with one
  replica (columns: loaded with C-level passes, no per-object record),
  ``others`` the ``[key, size, flags, checksum, [segment_id, offset, ...]]``
  records of the rest; then ``["__end__", object_count]``. Version 1 files
  (one such record per object, no chunks) still load.

The master opens a fresh journal (next seq) at every start and every
snapshot, so it never appends to a file that may have a torn tail.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec

from kvpool.master.config import FsyncPolicy
from kvpool.master.records import decode_frame

__all__ = [
    "CHUNK",
    "Journal",
    "SnapshotData",
    "SnapshotWriter",
    "check_frames",
    "encode_frames",
    "expand_chunk",
    "iter_frame_payloads",
    "iter_journal",
    "iter_snapshot",
    "list_journals",
    "list_snapshots",
    "read_journal",
    "read_snapshot",
]

log = logging.getLogger(__name__)

_HDR = struct.Struct("<II")
_JOURNAL_RE = re.compile(r"^journal-(\d{12})\.log$")
_SNAPSHOT_RE = re.compile(r"^snapshot-(\d{12})\.msgpack$")
SNAPSHOT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
CHUNK = 2  # a column chunk's tag (a version-1 record starts with its key: a str)
_MAX_RECORD = 1 << 30
_FRAME_RECORDS = 4096  # records per batch frame at most (bounds one frame's size)
_encode = msgspec.msgpack.Encoder().encode


def journal_path(data_dir: str, seq: int) -> str:
    return os.path.join(data_dir, f"journal-{seq:012d}.log")


def snapshot_path(data_dir: str, seq: int) -> str:
    return os.path.join(data_dir, f"snapshot-{seq:012d}.msgpack")


def _list(data_dir: str, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    out = []
    for name in os.listdir(data_dir):
        m = pattern.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(data_dir, name)))
    return sorted(out)


def list_journals(data_dir: str) -> list[tuple[int, str]]:
    """``[(seq, path)]`` sorted by seq."""
    return _list(data_dir, _JOURNAL_RE)


def list_snapshots(data_dir: str) -> list[tuple[int, str]]:
    """``[(seq, path)]`` sorted by seq."""
    return _list(data_dir, _SNAPSHOT_RE)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def frame(payload: bytes) -> bytes:
    return _HDR.pack(len(payload), zlib.crc32(payload)) + payload


def encode_frames(records: list[Any]) -> bytes:
    """``records`` as the journal writes them: batch frames of up to
    ``_FRAME_RECORDS`` records (b"" for none). The leader ships these same
    bytes to its standbys, which journal them as they are."""
    n = len(records)
    if n <= _FRAME_RECORDS:
        if not n:
            return b""
        payload = _encode(records)
        return _HDR.pack(len(payload), zlib.crc32(payload)) + payload
    parts = []
    for i in range(0, n, _FRAME_RECORDS):
        payload = _encode(records[i:i + _FRAME_RECORDS])
        parts.append(_HDR.pack(len(payload), zlib.crc32(payload)))
        parts.append(payload)
    return b"".join(parts)


def _array_len(payload: bytes | memoryview) -> int:
    """The item count of the msgpack array ``payload`` starts with (-1: not one)."""
    if not payload:
        return -1
    b = payload[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(payload) >= 3:
        return int.from_bytes(payload[1:3], "big")
    if b == 0xDD and len(payload) >= 5:
        return int.from_bytes(payload[1:5], "big")
    return -1


def check_frames(data: bytes) -> int:
    """Validate ``data`` (batch frames as :func:`encode_frames` writes them:
    whole frames, checksums, each payload a msgpack array of records) without
    decoding the records; return how many records they hold, -1 if invalid."""
    pos = 0
    n = len(data)
    count = 0
    view = memoryview(data)
    while pos < n:
        if pos + _HDR.size > n:
            return -1
        length, crc = _HDR.unpack_from(data, pos)
        start = pos + _HDR.size
        end = start + length
        if end > n:
            return -1
        payload = view[start:end]
        items = _array_len(payload)
        if items < 1 or zlib.crc32(payload) != crc:
            return -1
        count += items
        pos = end
    return count


def iter_frame_payloads(data: bytes) -> Iterator[memoryview]:
    """The payloads of the frames in ``data`` (validated by :func:`check_frames`)."""
    view = memoryview(data)
    pos = 0
    n = len(data)
    while pos < n:
        length, _crc = _HDR.unpack_from(data, pos)
        pos += _HDR.size
        yield view[pos:pos + length]
        pos += length


class Journal:
    """Append-only journal with group commit.

    ``append(record)`` buffers; ``commit()`` writes everything buffered with
    one ``write`` and fsyncs per the policy (``always``: now; ``interval``:
    when ``interval_s`` passed since the last fsync, see ``maybe_fsync``,
    on a background thread so the master's loop never waits for the disk).
    """

    def __init__(self, data_dir: str, seq: int, policy: FsyncPolicy,
                 interval_s: float = 0.1) -> None:
        self.data_dir = data_dir
        self.policy = policy
        self.interval_s = interval_s
        self.seq = seq
        self.records_written = 0
        self._buf: list[bytes] = []
        self._pending = 0  # records in _buf (each is a header part and a payload part)
        self._dirty = False
        self._last_fsync = time.monotonic()
        self._fd = self._open(seq)
        # interval policy: a thread fsyncs a duplicate of the descriptor
        # (rotation and close need not wait for it); at most one in flight
        self._syncs: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._syncer: threading.Thread | None = None
        self._syncing = False
        self.background_fsyncs = 0  # interval fsyncs done off the loop
        self.fsync_errors = 0

    def _open(self, seq: int) -> int:
        fd = os.open(journal_path(self.data_dir, seq), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o644)
        fsync_dir(self.data_dir)
        return fd

    def append(self, record: Any) -> None:
        self.append_many((record,))

    def append_many(self, records: Iterable[Any]) -> None:
        """Buffer ``records`` as batch frames (one encode and checksum per
        ``_FRAME_RECORDS``). msgspec's encoder writes the same msgpack as
        msgpack.packb, ~2x faster."""
        recs = records if isinstance(records, list) else list(records)
        self.append_frames(encode_frames(recs), len(recs))

    def append_frames(self, data: bytes, records: int) -> None:
        """Buffer ``data``, batch frames of ``records`` records as
        :func:`encode_frames` makes them (a group commit encoded once for
        the journal and the standbys; a standby's copy of the leader's)."""
        if data:
            self._buf.append(data)
            self._pending += records

    @property
    def buffered(self) -> int:
        """Records appended and not yet written."""
        return self._pending

    def commit(self) -> None:
        """Write buffered records (one write); fsync if the policy says so now."""
        if self._buf:
            data = b"".join(self._buf)
            self.records_written += self._pending
            self._pending = 0
            self._buf.clear()
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self._dirty = True
        if self._dirty and self.policy == FsyncPolicy.ALWAYS:
            self.fsync()

    def maybe_fsync(self) -> None:
        """Interval policy: when due (called from the loop's timer), start an
        fsync of everything written so far on the background thread and
        return at once. One whose predecessor still runs (a slow disk) waits
        for a later call: written data is fsync'ed no later than the disk
        allows, and the loop never blocks on it (an fsync took ~10 ms here
        under load, 10% of the loop's time at the 100 ms default)."""
        if (self._dirty and not self._syncing and self.policy == FsyncPolicy.INTERVAL
                and time.monotonic() - self._last_fsync >= self.interval_s):
            fd = os.dup(self._fd)  # synced and closed by the thread
            self._dirty = False
            self._last_fsync = time.monotonic()
            self._syncing = True
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._sync_loop, daemon=True,
                                                name="kvpool-journal-fsync")
                self._syncer.start()
            self._syncs.put(fd)

    def _sync_loop(self) -> None:
        while True:
            fd = self._syncs.get()
            if fd < 0:
                return
            try:
                os.fsync(fd)
                self.background_fsyncs += 1
            except OSError as exc:
                self.fsync_errors += 1
                self._dirty = True  # try again at the next interval
                log.error("journal fsync failed: %s", exc)
            finally:
                os.close(fd)
                self._syncing = False

    def wait_fsync(self, timeout_s: float = 10.0) -> bool:
        """Wait until no background fsync is in flight (for tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._syncing:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def fsync(self) -> None:
        os.fsync(self._fd)
        self._dirty = False
        self._last_fsync = time.monotonic()

    def rotate(self, seq: int, sync: bool = True) -> int:
        """Write what is buffered and continue in ``journal-<seq>``.

        ``sync=True``: fsync + close the old file now, return -1.
        ``sync=False``: return the old fd; the caller fsyncs and closes it
        (and fsyncs the directory) off the loop thread."""
        self.commit()
        old = self._fd
        self.seq = seq
        self.records_written = 0
        if sync:
            if self.policy != FsyncPolicy.NEVER:
                os.fsync(old)
            os.close(old)
            self._fd = self._open(seq)
            return -1
        self._fd = os.open(journal_path(self.data_dir, seq),
                           os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._dirty = True
        return old

    def close(self) -> None:
        """Flush everything and fsync (clean shutdown)."""
        if self._fd < 0:
            return
        self.commit()
        self.fsync()
        os.close(self._fd)
        self._fd = -1
        if self._syncer is not None:
            self._syncs.put(-1)
            self._syncer.join(timeout=10.0)
            self._syncer = None


def iter_journal(path: str, truncate: bool = True,
                 torn_at: list[int] | None = None) -> Iterator[list[Any]]:
    """The records of journal ``path`` frame by frame (typed:
    :func:`kvpool.master.records.decode_frame`; one that does not fit its
    type stays the plain value it decoded to), so a restore holds one
    frame's records at a time. On a torn/corrupt tail it stops there, appends
    where to ``torn_at`` and (if ``truncate``) cuts the file to its valid
    prefix."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    n = len(data)
    torn = False
    view = memoryview(data)
    while pos < n:
        if pos + _HDR.size > n:
            torn = True
            break
        length, crc = _HDR.unpack_from(data, pos)
        start = pos + _HDR.size
        end = start + length
        if length > _MAX_RECORD or end > n:
            torn = True
            break
        payload = view[start:end]
        if zlib.crc32(payload) != crc:
            torn = True
            break
        try:
            records = decode_frame(payload)
        except Exception:
            torn = True
            break
        pos = end
        yield records
    if torn:
        log.warning("journal %s: corrupt/torn tail at byte %d of %d; truncating", path, pos, n)
        if torn_at is not None:
            torn_at.append(pos)
        if truncate:
            with open(path, "r+b") as f:
                f.truncate(pos)
                f.flush()
                os.fsync(f.fileno())


def read_journal(path: str, truncate: bool = True) -> tuple[list[Any], bool]:
    """Every valid record of journal ``path`` (:func:`iter_journal`) and
    whether its tail was torn (and, if ``truncate``, cut)."""
    records: list[Any] = []
    torn: list[int] = []
    for frame_records in iter_journal(path, truncate, torn):
        records += frame_records
    return records, bool(torn)


@dataclass
class SnapshotData:
    seq: int
    segments: list[dict[str, Any]]
    objects: list[list[Any]] = field(default_factory=list)
    created: float = 0.0


_END = "__end__"


class SnapshotWriter:
    """An incremental (fuzzy) snapshot: the loop calls ``step`` between
    requests; a thread writes the chunks, fsyncs, renames.

    ``old_journal_fd`` (from ``Journal.rotate(sync=False)``) is fsync'ed and
    closed by the thread first. ``stream`` (a standby's ``[epoch, lsn,
    history]`` as of the rotation) goes into the header. ``done`` is set when finished; ``error`` is
    None on success.
    """

    def __init__(self, data_dir: str, seq: int, segments: list[dict[str, Any]],
                 key_chunks: Iterable[list[str]], old_journal_fd: int = -1,
                 stream: list[Any] | None = None,
                 tenants: list[list[Any]] | None = None) -> None:
        self.data_dir = data_dir
        self.seq = seq
        self._chunks = iter(key_chunks)  # pulled lazily: each chunk is copied when reached
        self.keys: list[str] = []
        self.pos = 0
        self.count = 0
        self.started = time.monotonic()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.final = snapshot_path(data_dir, seq)
        self._tmp = self.final + f".tmp.{os.getpid()}"
        self._packer = msgpack.Packer(use_bin_type=True)
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        header: dict[str, Any] = {"version": SNAPSHOT_VERSION, "seq": seq,
                                  "created": time.time(), "segments": segments}
        if stream is not None:  # a standby's: its position in the leader's log
            header["stream"] = stream
        if tenants:  # quotas set live (TENANT_SET): [[name, memory, disk, guaranteed], ...]
            header["tenants"] = tenants
        self._q.put(self._packer.pack(header))
        self._finished_feeding = False
        self._thread = threading.Thread(target=self._run, args=(old_journal_fd,),
                                        name="kvpool-snapshot", daemon=True)
        self._thread.start()

    def step(self, chunk_of: Any, budget_s: float = 0.004, chunk: int = 512) -> bool:
        """Serialize keys until ``budget_s`` is spent; ``chunk_of(keys)`` gives
        ``(column chunk, objects in it)`` of the keys still there
        (:meth:`kvpool.master.replay.Replay.snapshot_chunk`). Return True when
        all are queued."""
        if self._finished_feeding:
            return True
        pack = self._packer.pack
        deadline = time.perf_counter() + budget_s
        did_work = False
        while True:
            if self.pos >= len(self.keys):
                nxt = next(self._chunks, None)
                if nxt is None:
                    break
                self.keys, self.pos = nxt, 0
                continue
            if did_work and time.perf_counter() >= deadline:
                return False
            did_work = True
            keys = self.keys
            end = min(self.pos + chunk, len(keys))
            rec, n = chunk_of(keys[self.pos:end])
            self.pos = end
            if n:
                self.count += n
                self._q.put(pack(rec))
        self._q.put(pack([_END, self.count]))
        self._q.put(None)
        self._finished_feeding = True
        self.keys = []
        self._chunks = iter(())
        return True

    def _run(self, old_fd: int) -> None:
        try:
            if old_fd >= 0:
                os.fsync(old_fd)
                os.close(old_fd)
                fsync_dir(self.data_dir)
            with open(self._tmp, "wb", buffering=1 << 20) as f:
                while True:
                    data = self._q.get()
                    if data is None:
                        break
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(self._tmp, self.final)
            fsync_dir(self.data_dir)
        except BaseException as exc:  # reported by the loop; the journals stay
            self.error = exc
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
        finally:
            self.done.set()

    def abort(self) -> None:
        """Stop feeding (shutdown): the temp file is removed, no snapshot."""
        if not self._finished_feeding:
            self._finished_feeding = True
            self.keys = []
            self._q.put(None)
            self.error = RuntimeError("aborted")
        self._thread.join(30)
        if self.error is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass


def _check_chunk(rec: list[Any]) -> int:
    """The objects of column chunk ``rec``; ValueError if it is malformed."""
    if len(rec) != 3 or type(rec[1]) is not list or type(rec[2]) is not list:
        raise ValueError("bad column chunk")
    n = 0
    for group in rec[1]:
        if type(group) is not list or len(group) != 6 or type(group[0]) is not str:
            raise ValueError("bad column group")
        keys = group[1]
        m = len(keys)
        if any(type(col) is not list or len(col) != m for col in group[1:]):
            raise ValueError("column group of uneven columns")
        n += m
    for other in rec[2]:
        if type(other) is not list or len(other) != 5:
            raise ValueError("bad record")
    return n + len(rec[2])


def expand_chunk(rec: list[Any]) -> list[list[Any]]:
    """The object records (``[key, size, flags, checksum, wire]``) of column chunk ``rec``."""
    out: list[list[Any]] = []
    for seg_id, keys, sizes, flags, checksums, offsets in rec[1]:
        out += ([k, z, f, c, [seg_id, o]]
                for k, z, f, c, o in zip(keys, sizes, flags, checksums, offsets, strict=True))
    return out + list(rec[2])


def iter_snapshot(path: str) -> tuple[dict[str, Any], Iterator[list[Any]]]:
    """Stream a snapshot: (header, items): version 1 object records, or
    version 2 column chunks (``item[0] == CHUNK``, see the module docstring;
    checked: groups of even columns). The iterator raises ValueError at the
    end if the snapshot is torn (no end marker) or corrupt, so a caller
    applying items as they come must be ready to discard them."""
    f = open(path, "rb")  # closed by the generator
    unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=1 << 30,
                                read_size=1 << 20)
    try:
        header = next(unpacker)
    except Exception as exc:
        f.close()
        raise ValueError(f"{path}: unreadable snapshot header: {exc}") from exc
    if not isinstance(header, dict) or header.get("version") not in _READABLE_VERSIONS:
        f.close()
        raise ValueError(f"{path}: bad snapshot header")

    def records() -> Iterator[list[Any]]:
        count = 0
        try:
            for rec in unpacker:
                if type(rec) is not list or not rec:
                    raise ValueError(f"{path}: bad record")
                if rec[0] == CHUNK:
                    count += _check_chunk(rec)
                    yield rec
                    continue
                if len(rec) != 5:
                    if rec[0] == _END:
                        if rec[1] != count:
                            raise ValueError(f"{path}: count mismatch")
                        return
                    raise ValueError(f"{path}: bad record")
                count += 1
                yield rec
        except (msgpack.UnpackException, TypeError, IndexError) as exc:
            raise ValueError(f"{path}: corrupt snapshot: {exc}") from exc
        finally:
            f.close()
        raise ValueError(f"{path}: snapshot has no end marker (torn)")

    return header, records()


def read_snapshot(path: str) -> SnapshotData:
    """Load a snapshot whole (object records, column chunks expanded); raise
    ValueError if it is incomplete or corrupt."""
    header, items = iter_snapshot(path)
    snap = SnapshotData(int(header["seq"]), list(header["segments"]),
                        created=float(header.get("created", 0)))
    for rec in items:
        if rec[0] == CHUNK:
            snap.objects += expand_chunk(rec)
        else:
            snap.objects.append(rec)
    return snap

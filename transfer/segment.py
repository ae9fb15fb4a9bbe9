"""Local segments: the regions this process owns and serves to peers.

A :class:`LocalSegment` is what the transfer server and in-process paths read
and write. Offsets given to its methods are relative to the *usable region*
(``[base_offset, base_offset + size)`` of the underlying memory or file);
implementations add ``base_offset`` themselves. :class:`MemorySegment` is a
POSIX shared-memory region in ``/dev/shm`` named ``kvpool-...`` (mode 0600)
that same-host peers map directly (the ``shm`` transport). File segments
subclass :class:`LocalSegment` with ``kind = SegmentKind.FILE``.

Ownership is visible on the host: the owner holds an exclusive ``flock`` on
its ``/dev/shm/kvpool-*.seg`` file for the segment's lifetime (taken before
the name exists: the file is created unnamed, with O_TMPFILE, locked, sized,
then linked). The kernel drops the lock when the owner dies however it dies,
so :func:`reap_orphaned_shm` (run by every segment-owning process at setup
and periodically by the node daemon) removes exactly the files whose owner
is gone: ``LOCK_EX | LOCK_NB`` succeeding proves it. Files without the
``.seg`` suffix (older versions, no lock) are never touched.

Runs that share a host but not a master (separate deployments, test suites
run side by side) can keep apart: a process whose environment sets
``KVPOOL_SHM_TAG`` names its files ``kvpool~<tag>~...`` and its janitor
removes only orphans with that tag; one without a tag removes only untagged
(``kvpool-...``) orphans, as janitors of versions before tags did. A
janitor that removed another cluster's orphan could not unmount it at that
cluster's master, which would list it until the owner's
``client_ttl_s + client_grace_s``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
import uuid
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.types import TransferError, TransferOp

__all__ = [
    "SHM_DIR",
    "SHM_OWNED_SUFFIX",
    "SHM_PREFIX",
    "SHM_TAG_ENV",
    "LocalSegment",
    "MemorySegment",
    "map_shm",
    "reap_orphaned_shm",
    "shm_tag_prefix",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvpool-"
_TAGGED_PREFIX = "kvpool~"  # kvpool~<tag>~...: not SHM_PREFIX, so untagged janitors skip it
SHM_OWNED_SUFFIX = ".seg"  # files whose owner holds an flock on them while it lives
SHM_TAG_ENV = "KVPOOL_SHM_TAG"
_TAG_RE = re.compile(r"^[A-Za-z0-9_.]{1,32}$")
_PREFAULT_CHUNK = 64 << 20


class LocalSegment(ABC):
    """A segment owned by this process.

    Contract: ``size`` usable bytes; ``read_into``/``write_from`` copy between the
    usable region and a contiguous host buffer and raise ``TransferError``
    (OUT_OF_BOUNDS) for ranges outside it. ``allowed_ops`` are the ops peers
    may perform through the transfer server. ``close()`` releases the region.
    """

    kind: ClassVar[SegmentKind]
    segment_id: str
    size: int
    base_offset: int = 0
    allowed_ops: frozenset[TransferOp] = frozenset({TransferOp.READ, TransferOp.WRITE})

    @abstractmethod
    def descriptor(self, client_id: str, host_id: str, endpoint: str) -> SegmentDescriptor:
        """The descriptor a peer needs to reach this segment."""

    def view(self) -> memoryview | None:
        """Writable memoryview of the usable region when it is memory-mapped
        (in-place access, zero copy), else None (use read_into/write_from)."""
        return None

    def check_range(self, offset: int, length: int) -> None:
        """Raise OUT_OF_BOUNDS unless ``[offset, offset+length)`` is usable."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TransferError(
                f"range [{offset}, {offset + length}) outside segment {self.segment_id!r} "
                f"of {self.size} bytes",
                ErrorCode.OUT_OF_BOUNDS,
                retryable=False,
            )

    @abstractmethod
    def read_into(self, offset: int, dest: memoryview | np.ndarray) -> None:
        """Copy ``len(dest)`` bytes at usable ``offset`` into ``dest``."""

    @abstractmethod
    def write_from(self, offset: int, src: memoryview | np.ndarray | bytes) -> None:
        """Copy ``src`` into the usable region at ``offset``."""

    def read_payload(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at usable ``offset`` to send to a peer: a slice of
        ``view()`` when the region is mapped (zero copy), else a fresh copy.
        The caller has validated the range (the servers' ``_validate``)."""
        view = self.view()
        if view is not None:
            return view[offset:offset + length]
        buf = np.empty(length, dtype=np.uint8)
        self.read_into(offset, buf)
        return buf.data

    @abstractmethod
    def close(self) -> None:
        """Release the region (the owner also deletes it)."""

    def __enter__(self) -> LocalSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def map_shm(name: str, length: int, *, populate: bool = True) -> mmap.mmap:
    """Map an existing ``/dev/shm/<name>`` read-write (a peer's segment).

    ``populate`` pre-builds the page tables (MAP_POPULATE) so the first copy
    does not pay a fault per page. Raises SEGMENT_NOT_FOUND if it is gone.
    """
    if "/" in name or not name.startswith((SHM_PREFIX, _TAGGED_PREFIX)):
        raise TransferError(f"bad shm name {name!r}", ErrorCode.INVALID_PARAMS, retryable=False)
    try:
        fd = os.open(_shm_path(name), os.O_RDWR)
    except FileNotFoundError as exc:
        raise TransferError(f"shm {name} not found", ErrorCode.SEGMENT_NOT_FOUND) from exc
    except PermissionError as exc:
        raise TransferError(f"shm {name}: {exc}", ErrorCode.PERMISSION_DENIED,
                            retryable=False) from exc
    try:
        st = os.fstat(fd)
        if st.st_size < length:
            raise TransferError(
                f"shm {name} is {st.st_size} bytes, descriptor says {length}",
                ErrorCode.SEGMENT_MISMATCH, retryable=False,
            )
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _open_locked(path: str) -> tuple[int, bool]:
    """A new 0600 file for ``path``, already flock'ed by us: ``(fd, linked)``.

    Normally created unnamed (O_TMPFILE) so nobody can see it unlocked;
    ``linked`` False means the caller links it with :func:`_link_tmpfile`
    once it is ready. Where O_TMPFILE is unsupported the file is created
    under its name and locked right away (``linked`` True).
    """
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            fd = os.open(os.path.dirname(path), tmpfile | os.O_RDWR, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, False
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd, True


def _link_tmpfile(fd: int, path: str) -> None:
    """Give the unnamed file ``fd`` the name ``path`` (linkat through /proc,
    which needs no privilege)."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def shm_tag_prefix() -> str:
    """The name prefix of this process's segment files: ``kvpool-`` or, with
    ``KVPOOL_SHM_TAG`` set, ``kvpool~<tag>~`` (no tag is a prefix of another's
    files: ``~`` ends it and never appears in a tag)."""
    tag = os.environ.get(SHM_TAG_ENV, "")
    if not tag:
        return SHM_PREFIX
    if not _TAG_RE.match(tag):
        raise TransferError(f"{SHM_TAG_ENV}={tag!r}: 1-32 of [A-Za-z0-9_.]",
                            ErrorCode.INVALID_PARAMS, retryable=False)
    return f"{_TAGGED_PREFIX}{tag}~"


def reap_orphaned_shm(directory: str = SHM_DIR, prefix: str | None = None) -> list[str]:
    """Remove the ``<prefix>*.seg`` files in ``directory`` whose owner is dead
    (``prefix``: this process's :func:`shm_tag_prefix` by default).

    A file is an orphan when its owner's lock is gone (``LOCK_EX | LOCK_NB``
    succeeds): the owner process exited (kill -9 included) without
    unlinking it. Only files of this user are considered; a file whose owner
    lives is never touched. Returns the names removed. Cheap: one open and
    one flock per file.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.geteuid()
    own = shm_tag_prefix() if prefix is None else prefix
    for name in names:
        if not (name.startswith(own) and name.endswith(SHM_OWNED_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner holds the lock: alive
            try:
                if os.stat(path).st_ino != st.st_ino:
                    continue  # the name now names another file
                os.unlink(path)
            except FileNotFoundError:
                continue  # the owner (or another janitor) removed it first
            removed.append(name)
            log.warning("removed orphaned shared memory %s (%d bytes): its owner is gone",
                        name, st.st_size)
        except OSError as exc:
            log.debug("janitor: %s: %s", name, exc)
        finally:
            os.close(fd)
    return removed


class MemorySegment(LocalSegment):
    """A POSIX shared-memory segment owned by this process.

    Create with :meth:`create`; ``close()`` unmaps and unlinks it and drops
    the owner lock (module docstring). Fresh shm is slow to touch on these
    machines (first-touch page faults), so ``create`` pre-faults it by
    default (allocates every page and builds page tables).
    """

    kind = SegmentKind.MEMORY

    def __init__(self, segment_id: str, name: str, size: int, mm: mmap.mmap,
                 lock_fd: int = -1) -> None:
        self.segment_id = segment_id
        self.name = name
        self.size = size
        self.base_offset = 0
        self._lock_fd = lock_fd  # flock'ed while we own the segment (-1: none)
        self._mmap: mmap.mmap | None = mm
        self._array = np.frombuffer(mm, dtype=np.uint8, count=size)
        self._lock = threading.Lock()
        self.cache: dict[str, object] = {}  # per-transport state (e.g. CUDA registration)
        self.prefault_done = threading.Event()  # set when every page is allocated
        self.prefault_done.set()

    @classmethod
    def create(cls, segment_id: str, size: int,
               prefault: bool | str = True) -> MemorySegment:
        """Create ``/dev/shm/kvpool-<id>-<rand>`` of ``size`` bytes, mode 0600.

        ``prefault``: True allocates every page before returning (~1 s/GiB
        here); ``"background"`` returns at once and allocates in a daemon
        thread (``prefault_done`` is set when finished; data written meanwhile
        is never touched: allocation uses fallocate, mapping uses reads);
        False leaves first-touch faults to whoever writes first.
        """
        if prefault not in (True, False, "background"):
            raise TransferError(f"prefault must be true, false or 'background': {prefault!r}",
                                ErrorCode.INVALID_PARAMS, retryable=False)
        background = prefault == "background"
        prefault = prefault is True
        if size <= 0:
            raise TransferError(f"segment size must be > 0: {size}", ErrorCode.INVALID_PARAMS,
                                retryable=False)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", segment_id)[:64]
        name = f"{shm_tag_prefix()}{safe}-{uuid.uuid4().hex[:12]}{SHM_OWNED_SUFFIX}"
        path = _shm_path(name)
        fd, linked = _open_locked(path)
        try:
            os.ftruncate(fd, size)
            if prefault:
                # allocate every tmpfs page now, not at a peer's first touch
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise TransferError(
                        f"cannot allocate {size} bytes of shm: {exc}",
                        ErrorCode.NO_AVAILABLE_HANDLE, retryable=False,
                    ) from exc
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if not linked:
                _link_tmpfile(fd, path)
        except BaseException:
            if linked:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            os.close(fd)
            raise
        log.debug("created shm segment %s (%s, %d bytes)", segment_id, name, size)
        seg = cls(segment_id, name, size, mm, lock_fd=fd)
        if background:
            seg.prefault_done.clear()
            threading.Thread(target=seg._prefault_background, name=f"kvpool-prefault-{safe}",
                             daemon=True).start()
        return seg

    def _prefault_background(self) -> None:
        try:
            fd = os.open(_shm_path(self.name), os.O_RDWR)
        except OSError:
            self.prefault_done.set()
            return
        try:
            for off in range(0, self.size, _PREFAULT_CHUNK):
                if self._mmap is None:
                    return
                n = min(_PREFAULT_CHUNK, self.size - off)
                os.posix_fallocate(fd, off, n)  # allocates holes only; data stays
                arr = self._array
                if arr.size:
                    int(arr[off:off + n:4096].sum())  # read faults build our page tables
        except (OSError, ValueError):
            log.warning("background prefault of %s stopped", self.segment_id, exc_info=True)
        finally:
            os.close(fd)
            self.prefault_done.set()

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def address(self) -> int:
        """Address of the first usable byte in this process."""
        return int(self._array.ctypes.data)

    def array(self) -> np.ndarray:
        """uint8 numpy view of the usable region."""
        self._check_open()
        return self._array

    def descriptor(self, client_id: str, host_id: str, endpoint: str) -> SegmentDescriptor:
        return SegmentDescriptor(
            segment_id=self.segment_id, client_id=client_id, host_id=host_id,
            kind=SegmentKind.MEMORY, size=self.size, name=self.name, endpoint=endpoint,
            base_offset=0,
        )

    def view(self) -> memoryview | None:
        self._check_open()
        return self._array.data

    def _check_open(self) -> None:
        if self._mmap is None:
            raise TransferError(f"segment {self.segment_id} is closed", ErrorCode.CLOSED,
                                retryable=False)

    def read_into(self, offset: int, dest: memoryview | np.ndarray) -> None:
        self._check_open()
        d = np.frombuffer(dest, dtype=np.uint8) if not isinstance(dest, np.ndarray) else dest
        self.check_range(offset, d.nbytes)
        d[...] = self._array[offset:offset + d.nbytes]

    def write_from(self, offset: int, src: memoryview | np.ndarray | bytes) -> None:
        self._check_open()
        s = np.frombuffer(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src
        self.check_range(offset, s.nbytes)
        self._array[offset:offset + s.nbytes] = s

    def close(self) -> None:
        """Unmap and unlink. Idempotent."""
        with self._lock:
            mm, self._mmap = self._mmap, None
            if mm is None:
                return
            self._array = np.empty(0, np.uint8)
            unreg = self.cache.pop("cuda_unregister", None)
            if callable(unreg):
                try:
                    unreg()
                except Exception:  # best effort: the mapping goes away anyway
                    log.debug("cuda unregister failed", exc_info=True)
            try:
                mm.close()
            except BufferError:
                # a view is still exported (e.g. a zmq frame in flight); the
                # mapping is released when the last view dies
                log.debug("segment %s still has exported views", self.segment_id)
            try:
                os.unlink(_shm_path(self.name))
            except FileNotFoundError:
                pass
            # after the unlink: a janitor never finds our file unlocked
            fd, self._lock_fd = self._lock_fd, -1
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_mmap", None) is not None:
            try:
                self.close()
            except Exception:
                pass

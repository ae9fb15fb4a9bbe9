"""Local segments: the regions this process owns and serves to peers.

A :class:`LocalSegment` is what the transfer server and in-process paths read
and write. Offsets given to its methods are relative to the *usable region*
(``[base_offset, base_offset + size)`` of the underlying memory or file);
implementations add ``base_offset`` themselves. :class:`MemorySegment` is a
POSIX shared-memory region in ``/dev/shm`` named ``kvpool-...`` (mode 0600)
that same-host peers map directly (the ``shm`` transport). File segments
(issue 5) subclass :class:`LocalSegment` with ``kind = SegmentKind.FILE``.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
import uuid
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["SHM_DIR", "SHM_PREFIX", "LocalSegment", "MemorySegment", "map_shm"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvpool-"
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
    if "/" in name or not name.startswith(SHM_PREFIX):
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


class MemorySegment(LocalSegment):
    """A POSIX shared-memory segment owned by this process.

    Create with :meth:`create`; ``close()`` unmaps and unlinks it. Fresh shm is
    slow to touch on these machines (first-touch page faults), so ``create``
    pre-faults it by default (allocates every page and builds page tables).
    """

    kind = SegmentKind.MEMORY

    def __init__(self, segment_id: str, name: str, size: int, mm: mmap.mmap) -> None:
        self.segment_id = segment_id
        self.name = name
        self.size = size
        self.base_offset = 0
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
        name = f"{SHM_PREFIX}{safe}-{uuid.uuid4().hex[:12]}"
        fd = os.open(_shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            if prefault:
                # allocate every tmpfs page now, not at a peer's first touch
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.unlink(_shm_path(name))
                    raise TransferError(
                        f"cannot allocate {size} bytes of shm: {exc}",
                        ErrorCode.NO_AVAILABLE_HANDLE, retryable=False,
                    ) from exc
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if os.path.exists(_shm_path(name)):
                os.unlink(_shm_path(name))
            raise
        finally:
            os.close(fd)
        log.debug("created shm segment %s (%s, %d bytes)", segment_id, name, size)
        seg = cls(segment_id, name, size, mm)
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

    def __del__(self) -> None:
        if getattr(self, "_mmap", None) is not None:
            try:
                self.close()
            except Exception:
                pass

"""File segments: the SSD tier's regions, one preallocated file per segment.

Layout of a segment file::

    [0, HEADER_SIZE)              header (see below), padded to 4 KiB
    [base_offset, base_offset+size)  usable region (base_offset is 4 KiB aligned)

Header (little endian, CRC32 over every byte before the CRC field)::

    magic        8s   b"KVPLSEG\\0"
    version      u32  FORMAT_VERSION
    header_size  u32  HEADER_SIZE
    base_offset  u64
    size         u64  usable bytes
    generation   u64  bumped at every (re)open by an owner
    created_ns   u64
    id_len       u16
    segment_id   256s utf-8, zero padded
    crc32        u32

:meth:`FileSegment.open` creates the file (temp name, ``posix_fallocate``,
header, fsync, rename, so a crash mid-create never leaves a file with a valid
header) or reopens an existing one. Reopening validates the header (magic,
version, CRC, size, base offset, file length, expected segment id) and refuses
anything that does not match with :class:`SegmentFileError`
(``SEGMENT_MISMATCH``), never silently reusing or truncating a foreign file.
An exclusive ``flock`` keeps two owners from mounting the same file.

I/O goes straight between the caller's buffer and the file with
``os.preadv``/``os.pwritev`` (no intermediate bytes objects); ranges whose file
offset, length and buffer address are all 4 KiB aligned use a second
``O_DIRECT`` descriptor (bypassing the page cache) where the filesystem
supports it. :class:`FileIO` is the same I/O over a segment file owned by
another process on this host (the ``posix`` transport's peer path).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.types import TransferError

__all__ = [
    "ALIGN",
    "DEFAULT_FILE_NAME",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "FileIO",
    "FileSegment",
    "SegmentFileError",
    "SegmentHeader",
    "check_peer_header",
    "read_header",
]

log = logging.getLogger(__name__)

MAGIC = b"KVPLSEG\x00"
FORMAT_VERSION = 1
ALIGN = 4096
HEADER_SIZE = 4096
DEFAULT_FILE_NAME = "kvpool-segment.kvseg"
MAX_ID_BYTES = 256

_HDR = struct.Struct("<8sIIQQQQH256s")
_CRC = struct.Struct("<I")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class SegmentFileError(TransferError):
    """A segment file cannot be used: foreign, corrupt, truncated, another
    size or id than expected, or held by another owner. Never retryable."""

    code = ErrorCode.SEGMENT_MISMATCH

    def __init__(self, message: str, code: ErrorCode | int | None = None) -> None:
        super().__init__(message, code, retryable=False)


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """The decoded header of a segment file."""

    segment_id: str
    size: int
    base_offset: int
    generation: int
    created_ns: int
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        sid = self.segment_id.encode()
        body = _HDR.pack(MAGIC, self.version, HEADER_SIZE, self.base_offset, self.size,
                         self.generation, self.created_ns, len(sid), sid)
        raw = body + _CRC.pack(zlib.crc32(body))
        return raw + b"\x00" * (HEADER_SIZE - len(raw))

    @classmethod
    def decode(cls, raw: bytes, path: str = "?") -> SegmentHeader:
        """Parse ``raw`` (at least the header); raise SegmentFileError if it is
        not a valid kvpool segment header."""
        need = _HDR.size + _CRC.size
        if len(raw) < need:
            raise SegmentFileError(f"{path}: {len(raw)} bytes, too short for a segment header")
        magic, version, hsize, base, size, gen, created, id_len, sid = _HDR.unpack_from(raw)
        if magic != MAGIC:
            raise SegmentFileError(f"{path}: not a kvpool segment file (magic {magic!r})")
        (crc,) = _CRC.unpack_from(raw, _HDR.size)
        if crc != zlib.crc32(raw[:_HDR.size]):
            raise SegmentFileError(f"{path}: header checksum mismatch (corrupt header)")
        if version != FORMAT_VERSION:
            raise SegmentFileError(f"{path}: format version {version}, this build reads "
                                   f"{FORMAT_VERSION}", ErrorCode.INVALID_VERSION)
        if hsize != HEADER_SIZE or base < HEADER_SIZE or base % ALIGN or id_len > MAX_ID_BYTES:
            raise SegmentFileError(f"{path}: inconsistent header (header {hsize}, base {base})")
        try:
            segment_id = sid[:id_len].decode()
        except UnicodeDecodeError as exc:
            raise SegmentFileError(f"{path}: segment id is not utf-8") from exc
        return cls(segment_id, size, base, gen, created, version)


def read_header(path: str) -> SegmentHeader:
    """Read and validate the header of the segment file at ``path``."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except FileNotFoundError as exc:
        raise SegmentFileError(f"{path}: no such segment file", ErrorCode.SEGMENT_NOT_FOUND) \
            from exc
    return SegmentHeader.decode(raw, path)


def check_peer_header(desc: SegmentDescriptor) -> SegmentHeader:
    """Read the header of the segment file a descriptor names and check that it is
    the one the descriptor describes: same segment id, base offset and size
    (SegmentFileError SEGMENT_MISMATCH if not). Every transport that opens a
    peer's segment file goes through this before touching the data."""
    header = read_header(desc.name)
    if (header.segment_id != desc.segment_id or header.base_offset != desc.base_offset
            or header.size != desc.size):
        raise SegmentFileError(
            f"{desc.name}: holds segment {header.segment_id!r} ({header.size} B at "
            f"{header.base_offset}), descriptor says {desc.segment_id!r} ({desc.size} B at "
            f"{desc.base_offset})")
    return header


def _aligned(*values: int) -> bool:
    return all(v % ALIGN == 0 for v in values)


def _as_u8(buf: memoryview | np.ndarray | bytes) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


class FileIO:
    """Positional I/O on one segment file: a buffered and (where the filesystem
    allows) an ``O_DIRECT`` descriptor. Offsets are *absolute* file offsets.

    ``read(off, dest)``/``write(off, src)`` move ``len(buf)`` bytes straight
    between the buffer and the file (preadv/pwritev, looping over short
    transfers); a read past the end of the file is an error, never zeros.
    ``reads``/``read_bytes`` and ``writes``/``write_bytes`` count what moved
    through this process (a node's SSD tier I/O; no lock, like the transfer
    counters).
    """

    def __init__(self, path: str, writable: bool = True, direct: bool = True) -> None:
        self.path = path
        flags = (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags)
        except FileNotFoundError as exc:
            raise SegmentFileError(f"{path}: segment file is gone",
                                   ErrorCode.SEGMENT_NOT_FOUND) from exc
        except PermissionError as exc:
            raise TransferError(f"{path}: {exc}", ErrorCode.PERMISSION_DENIED,
                                retryable=False) from exc
        self.direct_fd = -1
        self.direct_reason = "O_DIRECT disabled"
        if direct and _O_DIRECT:
            try:
                self.direct_fd = os.open(path, flags | _O_DIRECT)
                self.direct_reason = ""
            except OSError as exc:  # tmpfs and some filesystems refuse O_DIRECT
                self.direct_reason = f"O_DIRECT refused: {exc.strerror}"
        elif not _O_DIRECT:
            self.direct_reason = "O_DIRECT not supported on this platform"
        self.direct_ops = 0
        self.buffered_ops = 0
        self.reads = self.read_bytes = self.writes = self.write_bytes = 0
        self._closed = False

    @property
    def has_direct(self) -> bool:
        return self.direct_fd >= 0

    def _fd_for(self, off: int, n: int, addr: int) -> int:
        if self.direct_fd >= 0 and n and _aligned(off, n, addr):
            self.direct_ops += 1
            return self.direct_fd
        self.buffered_ops += 1
        return self.fd

    def read(self, off: int, dest: memoryview | np.ndarray) -> None:
        """Fill ``dest`` from absolute file offset ``off``."""
        self._io(False, off, dest)

    def write(self, off: int, src: memoryview | np.ndarray | bytes) -> None:
        """Write all of ``src`` at absolute file offset ``off``."""
        self._io(True, off, src)

    def _io(self, write: bool, off: int, buf: memoryview | np.ndarray | bytes) -> None:
        """All of ``buf`` written at, or read from, absolute file offset ``off``."""
        a = _as_u8(buf)
        n = a.nbytes
        if n == 0:
            return
        fd = self._fd_for(off, n, int(a.ctypes.data))
        op = os.pwritev if write else os.preadv
        mv = a.data
        done = 0
        while done < n:
            try:
                got = op(fd, [mv[done:]], off + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and fd == self.direct_fd:
                    fd = self.fd  # filesystem refused this direct I/O: buffered
                    continue
                if not write:
                    code = ErrorCode.TRANSFER_FAIL
                elif exc.errno == errno.ENOSPC:
                    code = ErrorCode.NO_AVAILABLE_HANDLE
                else:
                    code = ErrorCode.WRITE_FAIL
                raise TransferError(f"{'write' if write else 'read'} {self.path}@{off + done}: "
                                    f"{exc}", code) from exc
            if got == 0 and not write:
                raise TransferError(f"read {self.path}@{off + done}: end of file "
                                    f"(file truncated?)", ErrorCode.SEGMENT_MISMATCH,
                                    retryable=False)
            done += got
        if write:
            self.writes += 1
            self.write_bytes += n
        else:
            self.reads += 1
            self.read_bytes += n

    def sync(self) -> None:
        """fdatasync: make written data durable across a host crash."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self.direct_fd, self.fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self.direct_fd = -1


def _lock_as_owner(fd: int, path: str) -> None:
    """Take the owner's exclusive ``flock`` of the segment file ``path``
    (open as ``fd``); SEGMENT_ALREADY_EXISTS while another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise SegmentFileError(f"{path}: in use by another process ({exc.strerror})",
                               ErrorCode.SEGMENT_ALREADY_EXISTS) from exc


def _resized(path: str, size: int) -> SegmentHeader | None:
    """The header of the segment file ``path`` when it is valid and of
    another size than ``size``; None otherwise (the open path decides)."""
    try:
        header = read_header(path)
    except (SegmentFileError, TransferError, OSError):
        return None
    return header if header.size != size else None


class FileSegment(LocalSegment):
    """A preallocated segment file owned (flocked) by this process.

    Open with :meth:`open`; ``close()`` releases the lock and the descriptors
    but keeps the file (the SSD tier survives its owner: warm restart).
    :meth:`destroy` closes and deletes it.
    """

    kind = SegmentKind.FILE

    def __init__(self, path: str, header: SegmentHeader, io: FileIO, created: bool) -> None:
        self.path = path
        self.header = header
        self.segment_id = header.segment_id
        self.size = header.size
        self.base_offset = header.base_offset
        self.generation = header.generation
        self.created = created  # False: reopened an existing file (warm restart)
        #: the id of the segment file this one replaced at another size (create)
        self.replaced: str | None = None
        self.io = io
        self.cache: dict[str, object] = {}  # per-transport state (e.g. kvikio handle)
        self._lock = threading.Lock()

    # -- open / create ----------------------------------------------------------
    @classmethod
    def open(cls, directory: str, size: int, segment_id: str | None = None, *,
             file_name: str = DEFAULT_FILE_NAME, create: bool = True,
             direct: bool = True) -> FileSegment:
        """Create or reopen the segment file ``directory/file_name``.

        New file: ``size`` usable bytes preallocated with posix_fallocate
        (``NO_AVAILABLE_HANDLE`` if the disk lacks the space), id
        ``segment_id`` or a fresh one. Existing file: the header must be valid
        and match ``size`` (and ``segment_id`` when given), and the file must
        hold the whole region; otherwise :class:`SegmentFileError`. The
        generation is bumped on every open. ``create=False`` refuses to create.
        """
        if size <= 0:
            raise TransferError(f"file segment size must be > 0: {size}",
                                ErrorCode.INVALID_PARAMS, retryable=False)
        if "/" in file_name or not file_name:
            raise TransferError(f"bad segment file name {file_name!r}",
                                ErrorCode.INVALID_PARAMS, retryable=False)
        directory = os.path.abspath(directory)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, file_name)
        if os.path.exists(path):
            return cls._reopen(path, size, segment_id, direct)
        if not create:
            raise SegmentFileError(f"{path}: no segment file", ErrorCode.SEGMENT_NOT_FOUND)
        return cls._create(path, size, segment_id or f"file-{uuid.uuid4().hex[:16]}", direct)

    @classmethod
    def create(cls, segment_id: str, directory: str, size: int, *,
               file_name: str = DEFAULT_FILE_NAME, direct: bool = True) -> FileSegment:
        """Open the node's segment file in ``directory`` for warm restart:
        reopen it if it exists (its id comes from the header; ``segment_id``
        is ignored then), else create it with id ``segment_id``.

        A valid file of another size (the configured size changed, e.g. one
        derived from the free disk space) is not refused: the tier starts
        afresh with a warning. The old file is removed (its objects are lost
        to the pool: the master drops its segment) and a new one is made
        with a fresh id, so no replica recorded in the old one can name the
        new file's bytes."""
        directory = os.path.abspath(directory)
        path = os.path.join(directory, file_name)
        if os.path.exists(path):
            old = _resized(path, size)
            if old is None:
                return cls.open(directory, size, None, file_name=file_name, direct=direct)
            cls._discard(path, old, size)
            seg = cls.open(directory, size, f"{segment_id}:{uuid.uuid4().hex[:8]}",
                           file_name=file_name, direct=direct)
            seg.replaced = old.segment_id
            return seg
        try:
            return cls.open(directory, size, segment_id, file_name=file_name, direct=direct)
        except SegmentFileError as exc:
            if exc.code != ErrorCode.SEGMENT_ALREADY_EXISTS:
                raise
            # another process created it between our check and our link
            return cls.open(directory, size, None, file_name=file_name, direct=direct)

    @staticmethod
    def _discard(path: str, old: SegmentHeader, size: int) -> None:
        """Remove the segment file ``path`` (header ``old``) to start the tier
        afresh at ``size`` bytes; refused while another process owns it."""
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            _lock_as_owner(fd, path)
            log.warning("%s: the SSD tier was %d bytes, now %d: starting it afresh (the %d "
                        "bytes of segment %s and its objects are dropped)", path, old.size,
                        size, old.size, old.segment_id)
            os.unlink(path)
        finally:
            os.close(fd)

    @classmethod
    def _create(cls, path: str, size: int, segment_id: str, direct: bool) -> FileSegment:
        if len(segment_id.encode()) > MAX_ID_BYTES or not segment_id:
            raise TransferError(f"bad segment id {segment_id!r}", ErrorCode.INVALID_PARAMS,
                                retryable=False)
        header = SegmentHeader(segment_id, size, HEADER_SIZE, 1, time.time_ns())
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                     0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, header.base_offset + size)
            except OSError as exc:
                code = ErrorCode.NO_AVAILABLE_HANDLE if exc.errno in (errno.ENOSPC, errno.EFBIG) \
                    else ErrorCode.WRITE_FAIL
                raise TransferError(f"cannot preallocate {size} bytes in {path}: "
                                    f"{exc.strerror}", code, retryable=False) from exc
            os.pwrite(fd, header.encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)
        # the final name appears only with a complete header
        try:
            os.link(tmp, path)  # fails if another process created it meanwhile
        except FileExistsError as exc:
            raise SegmentFileError(f"{path}: created concurrently by another process",
                                   ErrorCode.SEGMENT_ALREADY_EXISTS) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        seg = cls._attach(path, header, direct, created=True)
        log.info("created file segment %s at %s (%d B usable)", segment_id, path, size)
        return seg

    @classmethod
    def _reopen(cls, path: str, size: int, segment_id: str | None, direct: bool) -> FileSegment:
        header = read_header(path)
        if segment_id is not None and header.segment_id != segment_id:
            raise SegmentFileError(f"{path}: holds segment {header.segment_id!r}, expected "
                                   f"{segment_id!r}")
        if header.size != size:
            raise SegmentFileError(f"{path}: segment of {header.size} bytes, asked for {size} "
                                   f"(refusing to reuse it with another size)")
        length = os.stat(path).st_size
        if length < header.base_offset + header.size:
            raise SegmentFileError(f"{path}: truncated ({length} bytes, the header says "
                                   f"{header.base_offset + header.size})")
        header = SegmentHeader(header.segment_id, header.size, header.base_offset,
                               header.generation + 1, header.created_ns, header.version)
        seg = cls._attach(path, header, direct, created=False)
        try:
            os.pwrite(seg.io.fd, header.encode(), 0)
            os.fsync(seg.io.fd)
        except OSError as exc:
            seg.close()
            raise TransferError(f"{path}: cannot update header: {exc}", ErrorCode.WRITE_FAIL,
                                retryable=False) from exc
        log.info("reopened file segment %s at %s (generation %d)", header.segment_id, path,
                 header.generation)
        return seg

    @classmethod
    def _attach(cls, path: str, header: SegmentHeader, direct: bool,
                created: bool) -> FileSegment:
        io = FileIO(path, writable=True, direct=direct)
        try:
            _lock_as_owner(io.fd, path)
        except SegmentFileError:
            io.close()
            raise
        return cls(path, header, io, created)

    # -- LocalSegment -----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.io.fd < 0

    def descriptor(self, client_id: str, host_id: str, endpoint: str) -> SegmentDescriptor:
        """``size`` is the usable size; ``name`` the absolute path of the file;
        ``extra`` carries the generation and whether O_DIRECT works here."""
        return SegmentDescriptor(
            segment_id=self.segment_id, client_id=client_id, host_id=host_id,
            kind=SegmentKind.FILE, size=self.size, name=self.path, endpoint=endpoint,
            base_offset=self.base_offset,
            extra={"generation": self.generation, "o_direct": self.io.has_direct},
        )

    def _check_open(self) -> None:
        if self.io.fd < 0:
            raise TransferError(f"file segment {self.segment_id} is closed", ErrorCode.CLOSED,
                                retryable=False)

    def read_into(self, offset: int, dest: memoryview | np.ndarray) -> None:
        self._check_open()
        d = _as_u8(dest)
        self.check_range(offset, d.nbytes)
        self.io.read(self.base_offset + offset, d)

    def write_from(self, offset: int, src: memoryview | np.ndarray | bytes) -> None:
        self._check_open()
        s = _as_u8(src)
        self.check_range(offset, s.nbytes)
        self.io.write(self.base_offset + offset, s)

    def sync(self) -> None:
        """Flush written data to the device."""
        self._check_open()
        self.io.sync()

    def close(self) -> None:
        """Release the lock and descriptors; the file stays. Idempotent."""
        with self._lock:
            closer = self.cache.pop("close_hook", None)
            if callable(closer):
                try:
                    closer()
                except Exception:
                    log.debug("file segment close hook failed", exc_info=True)
            self.cache.clear()
            self.io.close()

    def destroy(self) -> None:
        """Close and delete the file."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

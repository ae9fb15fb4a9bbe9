"""Inline same-host shared-memory copies for the store's hot path.

The transfer engine runs every batch on its transport thread pools; for a
small same-host copy that thread hop (submit, worker wake-up, condition
wait) costs far more than the copy itself on a busy 2-core host. When the
engine's selector rules would send a request to ``shm`` first anyway, the
store performs that same copy inline: map the segment once (public
``kvpool.transfer.segment.map_shm``), ``np.copyto`` between it and the caller's
host buffer. Anything else (GPU buffers, file segments, other hosts, a rule
that does not pick shm first, any error) goes through the engine unchanged.

No capability is checked here (nor by the engine's ``shm`` transport): a
same-host segment is a mode-0600 file in /dev/shm, so only the same user on
the same host can map it at all. That is the documented trust boundary
(docs/security.md, "Shared memory on one host"); capabilities guard the
network path through transfer servers.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import numpy as np

from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.copy import parallel_copyto

__all__ = ["InlineShm"]

_U8 = np.dtype(np.uint8)

log = logging.getLogger(__name__)


def host_array(buf: Any) -> np.ndarray | None:
    """A flat uint8 numpy view of a host buffer, or None (GPU, non-contiguous, unknown)."""
    try:
        if type(buf) is np.ndarray and buf.dtype is _U8 and buf.ndim == 1 \
                and buf.strides[0] == 1:  # the common case: a flat uint8 array
            return buf
        if type(buf) is BufferHandle:  # a registered buffer (the other common case)
            arr = buf.array
            if buf.device == "cuda" or not isinstance(arr, np.ndarray):
                return None
            return arr if arr.size == buf.length else buf.host_view(0, buf.length)
        if isinstance(buf, bytes | bytearray):
            return np.frombuffer(buf, dtype=np.uint8)
        if isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous:
                return None
            return buf.reshape(-1).view(np.uint8)
        if isinstance(buf, tuple) and len(buf) == 2:
            addr, n = int(buf[0]), int(buf[1])
            if n == 0:
                return np.empty(0, np.uint8)
            return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))
        if isinstance(buf, memoryview):
            return np.frombuffer(buf, dtype=np.uint8) if buf.c_contiguous else None
        host_view = getattr(buf, "host_view", None)
        if host_view is not None and hasattr(buf, "is_gpu"):  # transfer BufferHandle
            arr = getattr(buf, "array", None)
            if buf.is_gpu or not isinstance(arr, np.ndarray):
                return None
            return arr if arr.size == buf.length else host_view(0, buf.length)
    except (TypeError, ValueError, AttributeError, BufferError):
        return None
    return None


class InlineShm:
    """Same-host shm copies without the engine's thread hop (see module docstring)."""

    def __init__(self, rules: list[Any], host_id: str, enabled: bool = True) -> None:
        self.enabled = enabled
        self._rules = rules
        self._host_id = host_id
        self._own: dict[str, np.ndarray] = {}  # segments this process owns
        self._maps: dict[str, tuple[Any, np.ndarray]] = {}  # peer id -> (mmap, array)
        self._decided: dict[tuple[str, bool], bool] = {}
        self._lock = threading.Lock()
        self.copies = 0

    def add_own(self, segment_id: str, array: np.ndarray) -> None:
        self._own[segment_id] = array

    def _shm_first(self, size: int) -> bool:
        """Whether the selector would pick shm first for same-host host-buffer memory."""
        for rule in self._rules:
            if rule.matches(SegmentKind.MEMORY, True, "cpu", size):
                return bool(rule.transports) and rule.transports[0] == "shm"
        return False

    def eligible(self, desc: SegmentDescriptor | None, size: int) -> bool:
        if not self.enabled or desc is None or desc.kind != SegmentKind.MEMORY \
                or desc.host_id != self._host_id:
            return False
        big = size >= (1 << 20)  # rules may split by size; two buckets cover ours
        key = (desc.segment_id, big)
        ok = self._decided.get(key)
        if ok is None:
            ok = self._shm_first(size)
            self._decided[key] = ok
        return ok

    def target(self, desc: SegmentDescriptor | None, size: int) -> np.ndarray | None:
        """The mapped region to copy ``size`` bytes to/from inline, or None
        when the copy is not eligible (or the segment cannot be mapped)."""
        if desc is None or not self.eligible(desc, size):
            return None
        try:
            return self.region(desc)
        except Exception as exc:
            log.debug("inline shm map of %s failed: %s", desc.segment_id, exc)
            return None

    def region(self, desc: SegmentDescriptor) -> np.ndarray:
        arr = self._own.get(desc.segment_id)
        if arr is not None:
            return arr
        m = self._maps.get(desc.segment_id)
        if m is not None:
            return m[1]
        from kvpool.transfer.segment import map_shm

        with self._lock:
            m = self._maps.get(desc.segment_id)
            if m is None:
                mm = map_shm(desc.name, desc.base_offset + desc.size)
                arr = np.frombuffer(mm, dtype=np.uint8, count=desc.size, offset=desc.base_offset)
                m = (mm, arr)
                self._maps[desc.segment_id] = m
        return m[1]

    def write(self, desc: SegmentDescriptor, offset: int, src: np.ndarray) -> None:
        """Copy ``src`` into the segment at ``offset`` (raises on any problem)."""
        region = self.region(desc)
        if offset < 0 or offset + src.size > region.size:
            raise ValueError("range outside segment")
        parallel_copyto(region[offset:offset + src.size], src)
        self.copies += 1

    def read(self, desc: SegmentDescriptor, offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.size`` bytes at ``offset`` of the segment into ``dst``."""
        region = self.region(desc)
        if offset < 0 or offset + dst.size > region.size:
            raise ValueError("range outside segment")
        parallel_copyto(dst, region[offset:offset + dst.size])
        self.copies += 1

    def read_bytes(self, desc: SegmentDescriptor, offset: int, length: int) -> bytes:
        """The bytes at ``[offset, offset+length)`` as a new ``bytes`` (one copy)."""
        region = self.region(desc)
        if offset < 0 or offset + length > region.size:
            raise ValueError("range outside segment")
        self.copies += 1
        return region[offset:offset + length].tobytes()

    def forget(self, segment_id: str) -> None:
        with self._lock:
            m = self._maps.pop(segment_id, None)
        self._own.pop(segment_id, None)
        if m is not None:
            try:
                m[0].close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it

    def close(self) -> None:
        for seg_id in list(self._maps):
            self.forget(seg_id)
        self._own.clear()

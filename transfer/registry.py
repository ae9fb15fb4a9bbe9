"""The segment registry: every segment this process can address, known once.

One :class:`SegmentRegistry` per engine (and so per store client) holds

- the descriptors of every segment the process has learned (its own, as it
  publishes them, and peers', as master replies name them), by segment id;
- the segments this process owns (:class:`kvpool.transfer.segment.LocalSegment`);
- one mapping per same-host shared-memory file (:class:`ShmMapping`): a
  segment this process owns is used in place, a peer's ``/dev/shm`` file is
  mapped once and the mapping shared by every user (the ``shm`` transport,
  GPU page-locking);
- which segments failed a transfer lately (tried last for a while).

A descriptor learned again unchanged costs a dict lookup and a comparison;
one whose id now names another region (its owner came back with the same
segment id) replaces the old one and every cached state of the old one is
dropped (the mapping here, connections and handles in the transports through
the ``on_forget`` listeners).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor
from kvpool.transfer.segment import LocalSegment, MemorySegment, map_shm
from kvpool.transfer.types import TransferError

__all__ = ["SegmentRegistry", "ShmMapping"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ShmMapping:
    """The usable region of a same-host memory segment in this process.

    ``mm`` is None for a segment this process owns (its array is used in
    place); ``view`` is the array's memoryview (made once: small copies go
    through it). ``cuda_registered`` is the CUDA page-lock state of the region
    (set once tried; guarded by ``lock``)."""

    name: str
    mm: mmap.mmap | None
    array: np.ndarray
    cuda_registered: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.view = self.array.data

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)


class SegmentRegistry:
    """Descriptors, owned segments and shm mappings of one process (module docstring).

    Thread-safe. ``host_id`` is this host; ``client_id`` the owning client
    (what this process's own descriptors name); ``endpoint`` the transfer
    server's address once it is known.
    """

    def __init__(self, host_id: str, client_id: str = "") -> None:
        self.host_id = host_id
        self.client_id = client_id
        self.endpoint = ""
        self._descs: dict[str, SegmentDescriptor] = {}
        self._local: dict[str, LocalSegment] = {}
        self._maps: dict[str, ShmMapping] = {}  # peers' same-host memory segments
        self._suspect: dict[str, float] = {}  # segment id -> monotonic time it is tried last until
        self._lock = threading.RLock()
        #: called with a segment id whose cached state must go (removed or replaced)
        self.on_forget: list[Callable[[str], None]] = []
        #: called with each descriptor learned or replaced (GPU warm-up)
        self.on_learn: list[Callable[[SegmentDescriptor, LocalSegment | None], None]] = []

    # ------------------------------------------------------------------ lookups

    def get(self, segment_id: str) -> SegmentDescriptor | None:
        """The descriptor of ``segment_id``, or None when it is not known."""
        return self._descs.get(segment_id)

    def local(self, segment_id: str) -> LocalSegment | None:
        """The segment object when this process owns ``segment_id``."""
        return self._local.get(segment_id)

    def resolve(self, segment_id: str) -> tuple[SegmentDescriptor, LocalSegment | None]:
        """The descriptor a request for ``segment_id`` goes by and the segment
        object when this process owns it; SEGMENT_NOT_FOUND when unknown."""
        desc = self._descs.get(segment_id)
        if desc is None:
            raise TransferError(f"unknown segment {segment_id!r} (add_peer_segment first)",
                                ErrorCode.SEGMENT_NOT_FOUND, retryable=False)
        return desc, self._local.get(segment_id)

    def own(self) -> dict[str, SegmentDescriptor]:
        """The descriptors of the segments this process owns, by id."""
        with self._lock:
            return {sid: self._descs[sid] for sid in self._local if sid in self._descs}

    def known(self) -> list[tuple[SegmentDescriptor, LocalSegment | None]]:
        """Every known segment with its object where this process owns it."""
        with self._lock:
            return [(d, self._local.get(sid)) for sid, d in self._descs.items()]

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._descs

    # ------------------------------------------------------------------ learning

    def learn(self, segments: Mapping[str, SegmentDescriptor]) -> None:
        """Learn descriptors (``{segment_id: descriptor}``). One known
        unchanged is skipped; one that now names another region replaces it
        (every cached state of the old one is dropped). A segment this
        process owns keeps the descriptor it published."""
        descs = self._descs
        for sid, desc in segments.items():
            known = descs.get(sid)
            if known is desc or (known is not None and known.name == desc.name
                                 and known.client_id == desc.client_id):
                continue
            with self._lock:
                if sid in self._local:
                    continue  # ours: the master's copy adds nothing
                known = descs.get(sid)
                if known is not None and known.name == desc.name \
                        and known.client_id == desc.client_id:
                    continue
                descs[sid] = desc
                if known is not None:
                    self._drop_cached(sid)
            for fn in self.on_learn:
                fn(desc, None)

    def forget(self, segment_id: str) -> None:
        """Forget a peer's segment and drop what was cached for it (the next
        use learns it anew). A segment this process owns is kept."""
        with self._lock:
            if segment_id in self._local or self._descs.pop(segment_id, None) is None:
                return
            self._drop_cached(segment_id)

    def _drop_cached(self, segment_id: str) -> None:
        m = self._maps.pop(segment_id, None)
        if m is not None:
            _unmap(m)
        for fn in self.on_forget:
            try:
                fn(segment_id)
            except Exception as exc:  # one listener must not keep the others from forgetting
                log.debug("forgetting %s: %s", segment_id, exc)

    def add_local(self, segment: LocalSegment, desc: SegmentDescriptor) -> None:
        """Register a segment this process owns, published as ``desc``."""
        with self._lock:
            sid = segment.segment_id
            if self._local.get(sid, segment) is not segment:
                raise TransferError(f"segment {sid!r} already added",
                                    ErrorCode.SEGMENT_ALREADY_EXISTS, retryable=False)
            self._local[sid] = segment
            old = self._descs.get(sid)
            self._descs[sid] = desc
            if old is not None and old.name != desc.name:
                self._drop_cached(sid)
        for fn in self.on_learn:
            fn(desc, segment)

    def remove_local(self, segment_id: str) -> None:
        """Stop addressing an owned segment as ours (the owner closes it)."""
        with self._lock:
            if self._local.pop(segment_id, None) is None:
                return
            self._descs.pop(segment_id, None)
            self._drop_cached(segment_id)

    # ------------------------------------------------------------------ shared memory

    def mapping(self, desc: SegmentDescriptor, local: LocalSegment | None) -> ShmMapping:
        """The one mapping of a same-host memory segment: an owned segment in
        place, a peer's ``/dev/shm`` file mapped on first use. Raises
        TransferError (SEGMENT_NOT_FOUND when the file is gone)."""
        if local is not None:
            if not isinstance(local, MemorySegment):
                raise TransferError(f"segment {desc.segment_id} is not a memory segment",
                                    ErrorCode.INVALID_PARAMS, retryable=False)
            m = local.cache.get("shm_mapping")
            if not isinstance(m, ShmMapping) or m.array.size != local.size:
                m = ShmMapping(local.name, None, local.array())
                local.cache["shm_mapping"] = m
            return m
        sid = desc.segment_id
        m = self._maps.get(sid)
        if m is not None and m.name == desc.name and m.array.size == desc.size:
            return m
        with self._lock:
            m = self._maps.get(sid)
            if m is not None and m.name == desc.name and m.array.size == desc.size:
                return m
            if m is not None:
                del self._maps[sid]
                _unmap(m)
            mm = map_shm(desc.name, desc.base_offset + desc.size)
            arr = np.frombuffer(mm, dtype=np.uint8, count=desc.size, offset=desc.base_offset)
            m = self._maps[sid] = ShmMapping(desc.name, mm, arr)
            return m

    def mapped(self) -> int:
        """How many peers' shm files are mapped."""
        return len(self._maps)

    # ------------------------------------------------------------------ failures

    def suspect(self, segment_id: str, seconds: float) -> None:
        """Try ``segment_id``'s replicas last for ``seconds`` (a transfer from
        it just failed) and forget its cached state."""
        self._suspect[segment_id] = time.monotonic() + seconds
        self.forget(segment_id)

    def suspect_until(self, segment_id: str) -> float:
        """The monotonic time until which ``segment_id`` is tried last (0.0: not)."""
        return self._suspect.get(segment_id, 0.0) if self._suspect else 0.0

    def close(self) -> None:
        """Unmap every peer's segment (owned segments are their owner's)."""
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for m in maps:
            _unmap(m)


def _unmap(m: ShmMapping) -> None:
    """Release a peer's mapping: CUDA page-lock first, then the mmap (a view
    still held elsewhere keeps the pages until it goes)."""
    with m.lock:  # waits for a registration in progress (GPU warm-up)
        if m.cuda_registered and m.mm is not None:
            from kvpool.transfer.gpu import cuda_runtime

            rt = cuda_runtime()[0]
            if rt is not None:
                try:
                    rt.host_unregister(m.address)
                except Exception:
                    log.debug("cudaHostUnregister failed", exc_info=True)
        m.cuda_registered = True  # never register a dropped mapping
        if m.mm is not None:
            m.array = np.empty(0, np.uint8)
            m.view = m.array.data
    if m.mm is not None:
        try:
            m.mm.close()
        except BufferError:
            pass  # a caller still holds a view; freed with it


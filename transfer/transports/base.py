"""The narrow interface every transport implements.

A transport moves the bytes of resolved requests (:class:`WorkItem`) between
caller buffers and segments. The engine picks a transport per request (the
selector), groups requests into sub-batches and calls :meth:`Transport.execute`
on a worker thread, possibly several times in parallel for one sub-batch
(``settings.threads``). ``execute`` must call ``report(item, error)`` exactly
once per item (``error`` None on success; :func:`report_done` reports many
successes in one call) and return by ``deadline`` (``time.monotonic()``
seconds): a dead peer must become a retryable ``TransferError``, never a hang.
Items it does not report are failed by the engine.
``TransferError.retryable=False`` means "no other transport can do better"
(bounds, ownership, bad parameters): the engine does not fail over.

To add a transport: subclass, set ``name``, register ``"name":
"module:Class"`` in :mod:`kvpool.transfer.transports` (lazy import) and give it
a ``transports.<name>`` section in configs/transfer.yaml.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.types import TransferError, TransferRequest

if TYPE_CHECKING:
    from kvpool.transfer.config import TransportSettings
    from kvpool.transfer.registry import SegmentRegistry
    from kvpool.transfer.segment import LocalSegment

__all__ = ["EngineContext", "PeerFiles", "ReportFn", "Transport", "WorkItem", "as_transfer_error",
           "report_done"]


#: a request as a transport sees it: resolved by the engine (see TransferRequest)
WorkItem = TransferRequest

ReportFn = Callable[[WorkItem, TransferError | None], None]


def report_done(report: ReportFn, items: Sequence[WorkItem]) -> None:
    """``report(item, None)`` for every item of ``items``: in one call through
    the report's ``many`` attribute where it has one (the engine's takes its
    lock once for all of them), else item by item."""
    many = getattr(report, "many", None)
    if many is not None:
        many(items)
        return
    for it in items:
        report(it, None)

def as_transfer_error(exc: BaseException, what: str) -> TransferError:
    """What a transport reports for ``exc``: itself when it is a
    TransferError, else a retryable TRANSFER_FAIL "``what`` failed: ..."."""
    if isinstance(exc, TransferError):
        return exc
    return TransferError(f"{what} failed: {exc}", ErrorCode.TRANSFER_FAIL)


_H = TypeVar("_H")


class PeerFiles(Generic[_H]):
    """Open handles to same-host peers' segment files, by segment id (posix: FileIO,
    gds: kvikio.CuFile). ``get()`` reuses the handle while the descriptor names the
    same file, closes it and opens anew (through ``opener``, which checks the file's
    header) when it names another. Thread-safe; ``opener`` runs under the lock, so
    one segment is never opened twice at once.
    """

    def __init__(self, opener: Callable[[SegmentDescriptor], _H]) -> None:
        self._opener = opener
        self._files: dict[str, tuple[str, _H]] = {}  # segment id -> (path, handle)
        self._lock = threading.Lock()

    def get(self, item: WorkItem) -> _H:
        """The handle for ``item``'s peer segment. The caller handles a local
        FileSegment first; any other local segment is INVALID_PARAMS."""
        if item.local is not None:
            raise TransferError(f"segment {item.segment.segment_id} is not a file segment",
                                ErrorCode.INVALID_PARAMS, retryable=False)
        desc = item.segment
        with self._lock:
            cached = self._files.get(desc.segment_id)
            if cached is not None and cached[0] == desc.name:
                return cached[1]
            if cached is not None:
                cached[1].close()  # type: ignore[attr-defined]
            handle = self._opener(desc)
            self._files[desc.segment_id] = (desc.name, handle)
            return handle

    def forget(self, segment_id: str) -> None:
        """Close and drop the handle of ``segment_id`` (no-op if none is open)."""
        with self._lock:
            cached = self._files.pop(segment_id, None)
        if cached is not None:
            cached[1].close()  # type: ignore[attr-defined]

    def take_all(self) -> list[_H]:
        """Drop every handle and return them; the caller closes them."""
        with self._lock:
            files, self._files = list(self._files.values()), {}
        return [h for _, h in files]

    def __len__(self) -> int:
        return len(self._files)


class EngineContext(Protocol):
    """What the engine offers its transports."""

    @property
    def host_id(self) -> str: ...

    @property
    def tcp_congestion(self) -> str:
        """``TransferConfig.tcp_congestion``: the policy of tcp bulk sockets."""
        ...

    def local_segment(self, segment_id: str) -> LocalSegment | None: ...

    @property
    def registry(self) -> SegmentRegistry:
        """The process's segment registry (descriptors, shm mappings)."""
        ...


class Transport(ABC):
    """Base of all transports. Subclasses set ``name`` and implement
    :meth:`available`, :meth:`supports` and :meth:`execute`.

    Construction is cheap and must not touch hardware; the engine calls
    :meth:`attach` once, then :meth:`available` (skipping the transport with
    one log line if it says no). ``settings`` is the transport's section of
    the config (defaults when None).
    """

    name: ClassVar[str] = "base"

    def __init__(self, settings: TransportSettings | None = None) -> None:
        if settings is None:
            from kvpool.transfer.config import TransportSettings

            settings = TransportSettings()
        self.settings = settings
        self.ctx: EngineContext | None = None
        self._closed = False

    def attach(self, ctx: EngineContext) -> None:
        """Called by the engine before first use."""
        self.ctx = ctx

    @abstractmethod
    def available(self) -> tuple[bool, str]:
        """(True, "") if usable here, else (False, reason) e.g. "no CUDA device"."""

    @abstractmethod
    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        """Whether this transport can serve requests to segments of ``kind``
        (same host or not) with buffers on ``device`` ("cpu" | "cuda")."""

    @abstractmethod
    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        """Perform ``items``; ``report(item, None | TransferError)`` once each;
        return by ``deadline`` (monotonic seconds)."""

    def forget_segment(self, segment_id: str) -> None:  # noqa: B027 - optional hook
        """Drop any cached state for a segment (unmounted / removed)."""

    def warm_gpu(self, segment: SegmentDescriptor,  # noqa: B027 - optional hook
                 local: LocalSegment | None, same_host: bool) -> None:
        """Get ready to move GPU buffers to/from ``segment`` (``local``: owned by
        this process) before the first such request, e.g. page-lock its mapping
        or a staging pool. Called from a background thread once the engine has
        a registered GPU buffer, for every segment it knows or learns; a request
        racing it must still be correct (it may wait for, or do, the same work)."""

    def stats(self) -> dict[str, Any]:
        """Transport-specific counters (for logs and benchmarks)."""
        return {}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release sockets/mappings. Idempotent."""
        self._closed = True

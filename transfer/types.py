"""Request, status and error types of the transfer engine.

These are the public value types of ``kvpool.transfer`` (see docs/INTERFACES.md).
The engine never knows about keys: a request names a buffer slice, a segment id,
an offset inside the segment's usable region and a length.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any

import msgspec

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "RequestState",
    "RequestStatus",
    "TransferError",
    "TransferOp",
    "TransferRequest",
    "done_status",
]


class TransferOp(IntEnum):
    """READ copies segment -> buffer; WRITE copies buffer -> segment."""

    READ = 1
    WRITE = 2


class RequestState(Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.DONE, RequestState.FAILED)


class TransferError(KVPoolError):
    """A transfer failed. ``retryable`` says whether another attempt (the same
    transport again or the next one in the rule) may succeed: a timeout or a
    dead peer is retryable, a bounds/ownership refusal is not."""

    code = ErrorCode.TRANSFER_FAIL

    def __init__(
        self, message: str = "", code: ErrorCode | int | None = None, *, retryable: bool = True
    ) -> None:
        super().__init__(message, code)
        self.retryable = retryable


class TransferRequest(msgspec.Struct, eq=False):
    """One copy between a buffer slice and a segment range: the one request
    form from the caller to the transports (and, for tcp, the wire).

    The caller sets the first eight fields. ``offset`` is relative to the
    segment's usable region (add the descriptor's ``base_offset`` for the
    absolute position). ``buffer`` is anything
    :func:`kvpool.transfer.buffers.as_buffer` accepts, or a ``BufferHandle``.
    ``transport`` forces a transport by name (overrides the selector rules).
    ``capability`` is an opaque token the segment owner may verify
    (docs/security.md).

    The engine *resolves* a request when it takes it: it replaces ``buffer``
    by its ``BufferHandle`` and fills in the rest, which the transports read:
    ``index`` (the position in its batch), ``segment`` (the descriptor the
    request goes by), ``same_host``, ``local`` (the segment object when this
    process owns it) and ``independent`` (the batch was submitted inside
    :func:`kvpool.transfer.gpu.independent_copies`). A request belongs to one
    batch at a time. (A msgspec Struct: made per key on hot paths, it costs
    a third of a dataclass.)
    """

    op: TransferOp
    buffer: Any
    segment_id: str
    offset: int
    length: int
    buffer_offset: int = 0
    transport: str | None = None
    capability: bytes = b""
    # resolved by the engine (see above)
    index: int = 0
    segment: Any = None  # SegmentDescriptor
    same_host: bool = False
    local: Any = None  # LocalSegment | None
    independent: bool = False

    @property
    def device(self) -> str:
        """"cpu" or "cuda": where the (resolved) buffer lives."""
        return self.buffer.device  # type: ignore[no-any-return]


class RequestStatus(msgspec.Struct, eq=False, frozen=True):
    """Where one request stands: ``transport`` is the one that served it (DONE)
    or tried last (FAILED); ``errors`` lists every failed attempt in order as
    ``"<transport>: <message>"``; ``code`` is OK when DONE, else the last error.

    Read-only: the engine hands one status object to every request a
    transport served at its first attempt (:func:`done_status`), so
    ``errors`` must not be modified either."""

    state: RequestState = RequestState.PENDING
    transport: str | None = None
    code: ErrorCode = ErrorCode.OK
    errors: list[str] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state is RequestState.DONE


_DONE_STATUS: dict[str, RequestStatus] = {}


def done_status(transport: str) -> RequestStatus:
    """The status of a request ``transport`` served at its first attempt: one
    shared object per transport (made per request, it was a tenth of the
    engine's CPU for a batch of 32 small requests)."""
    st = _DONE_STATUS.get(transport)
    if st is None:
        st = _DONE_STATUS[transport] = RequestStatus(RequestState.DONE, transport, ErrorCode.OK)
    return st

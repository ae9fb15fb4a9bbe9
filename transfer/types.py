"""Request, status and error types of the transfer engine.

These are the public value types of ``kvpool.transfer`` (see docs/INTERFACES.md).
The engine never knows about keys: a request names a buffer slice, a segment id,
an offset inside the segment's usable region and a length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "RequestState",
    "RequestStatus",
    "TransferError",
    "TransferOp",
    "TransferRequest",
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


@dataclass(slots=True)
class TransferRequest:
    """One copy between a buffer slice and a segment range.

    ``offset`` is relative to the segment's usable region (the engine adds the
    descriptor's ``base_offset``). ``buffer`` is anything
    :func:`kvpool.transfer.buffers.as_buffer` accepts, or a ``BufferHandle``.
    ``transport`` forces a transport by name (overrides the selector rules).
    ``capability`` is an opaque token the segment owner may verify (docs/security.md).
    """

    op: TransferOp
    buffer: Any
    segment_id: str
    offset: int
    length: int
    buffer_offset: int = 0
    transport: str | None = None
    capability: bytes = b""


@dataclass(slots=True)
class RequestStatus:
    """Where one request stands: ``transport`` is the one that served it (DONE)
    or tried last (FAILED); ``errors`` lists every failed attempt in order as
    ``"<transport>: <message>"``; ``code`` is OK when DONE, else the last error."""

    state: RequestState = RequestState.PENDING
    transport: str | None = None
    code: ErrorCode = ErrorCode.OK
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state is RequestState.DONE

"""kvpool.transfer: the transfer engine (batches, sub-batches, transports).

Public API (docs/INTERFACES.md, "Transfer engine")::

    cfg = load_transfer_config()
    engine = TransferEngine(cfg, host_id="node-a")
    seg = MemorySegment.create("seg-0", 64 << 20)
    engine.add_local_segment(seg)
    statuses = engine.transfer([TransferRequest(TransferOp.WRITE, b"abc", "seg-0", 0, 3)],
                               timeout=5)

The engine knows nothing of keys: it moves bytes between buffers and segments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.transfer.buffers import BufferHandle, as_buffer
from kvpool.transfer.config import (
    RuleConfig,
    ServerConfig,
    TransferConfig,
    TransportSettings,
    load_transfer_config,
)
from kvpool.transfer.segment import LocalSegment, MemorySegment
from kvpool.transfer.types import (
    RequestState,
    RequestStatus,
    TransferError,
    TransferOp,
    TransferRequest,
)

if TYPE_CHECKING:
    from kvpool.transfer.engine import BatchHandle, TransferEngine

__all__ = [
    "BatchHandle",
    "BufferHandle",
    "LocalSegment",
    "MemorySegment",
    "RequestState",
    "RequestStatus",
    "RuleConfig",
    "ServerConfig",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferOp",
    "TransferRequest",
    "TransportSettings",
    "as_buffer",
    "load_transfer_config",
]


def __getattr__(name: str) -> Any:
    # the engine pulls in zmq and the transport registry; import it on first use
    if name in ("TransferEngine", "BatchHandle"):
        from kvpool.transfer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvpool.transfer' has no attribute {name!r}")

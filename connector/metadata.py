"""What the scheduler-side connector tells the workers each step.

Plain dataclasses (picklable, no vLLM import): vLLM ships the metadata to
every worker inside ``SchedulerOutput``. ``kvpool.connector.vllm`` wraps
:class:`ConnectorMeta` in a ``KVConnectorMetadata`` subclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ChunkRef", "ConnectorMeta", "LoadSpec", "SaveSpec"]


@dataclass
class ChunkRef:
    """One chunk of one request: its index in the sequence, chained hash and
    the vLLM block ids holding it (``blocks_per_chunk`` of them, in order)."""

    index: int
    hash: str
    block_ids: list[int]


@dataclass
class LoadSpec:
    """Load ``chunks`` of request ``req_id`` into their blocks.

    ``skip_blocks`` leading blocks of the first chunk are already computed
    locally (vLLM's prefix cache) and must not be written; only the first
    ``last_blocks`` blocks of the last chunk are written (0 = all: a chunk
    ending at the prompt's end keeps its last block for vLLM to compute, as
    at least one prompt token must be computed). ``is_async``: the
    load runs in the background and completion is reported by
    ``get_finished`` (else it completes before the forward).
    """

    req_id: str
    chunks: list[ChunkRef]
    skip_blocks: int = 0
    is_async: bool = False
    last_blocks: int = 0


@dataclass
class SaveSpec:
    """Store ``chunks`` of request ``req_id``; their blocks are complete after this step."""

    req_id: str
    chunks: list[ChunkRef]


@dataclass
class ConnectorMeta:
    """One scheduler step's loads and saves, and requests preempted this step
    (their blocks may be reused: pending saves must finish first)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted_req_ids)

"""What the scheduler-side connector tells the workers each step.

Plain dataclasses (picklable, no vLLM import): vLLM ships the metadata to
every worker inside ``SchedulerOutput``. ``kvpool.connector.vllm`` wraps
:class:`ConnectorMeta` in a ``KVConnectorMetadata`` subclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChunkRef", "ConnectorMeta", "LoadSpec", "SaveSpec", "StateRef", "WorkerReport"]


@dataclass
class ChunkRef:
    """One chunk of one request: its index in the sequence, chained hash and
    the vLLM block ids holding it: ``blocks_per_chunk`` of them per KV-cache
    group, group after group (one group: just its blocks). -1 marks a block
    the request does not hold (a sliding-window group's block outside the
    window: vLLM's null block), never read nor written."""

    index: int
    hash: str
    block_ids: list[int]
    peer: str = ""  # where its nearest replica is (estimate.peer_key); "" = unknown
    head_objects: int = 0  # objects per layer group it is stored as (0 = the reader's split)


@dataclass
class StateRef:
    """The recurrent state (Mamba / linear attention) of state group ``group``
    after chunk ``index`` (hash ``hash``): the block ``block_id`` of that
    group holding it (vLLM's exact block: a state group's block table is
    not positional). -1: the request holds no block there (a load fails)."""

    group: int
    index: int
    hash: str
    block_id: int
    pin: int = -1  # the scheduler's pin of the block (a save reports it done)


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
    ``deadline_s``: the load is abandoned after this long (0 = the worker's
    ``load_timeout_s``); ``predicted_s``: the scheduler's estimate of its
    time (None = not estimated), reported next to the actual time.
    """

    req_id: str
    chunks: list[ChunkRef]
    skip_blocks: int = 0
    is_async: bool = False
    last_blocks: int = 0
    deadline_s: float = 0.0
    predicted_s: float | None = None
    located: Any = None
    # the state at the load's end, per state group (a load fails without it)
    states: list[StateRef] = field(default_factory=list)


@dataclass
class SaveSpec:
    """Store ``chunks`` of request ``req_id``, and the recurrent ``states``
    vLLM checkpointed; their blocks are complete after this step."""

    req_id: str
    chunks: list[ChunkRef]
    states: list[StateRef] = field(default_factory=list)


@dataclass
class ConnectorMeta:
    """One scheduler step's loads and saves, requests preempted this step (their
    blocks may be reused: pending saves must finish first), whether pending
    saves must finish first for another reason (``flush_saves``) and the tokens the
    step computes (the worker times the forward: prefill throughput)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    scheduled_tokens: int = 0
    # finish pending saves before the forward: a sliding-window block they read
    # was freed by vLLM (out of the window) and handed to a request this step
    flush_saves: bool = False

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted_req_ids or self.flush_saves)


@dataclass
class WorkerReport:
    """What a worker measured since its last report, for the scheduler's
    load-or-recompute estimates: completed loads ``(peer, bytes, seconds)``,
    peers whose load failed or overran, forward passes ``(tokens, seconds)``;
    and the pins (:attr:`StateRef.pin`) of the state saves it finished
    (their blocks may go once every rank reported them)."""

    loads: list[tuple[str, int, float]] = field(default_factory=list)
    failed_peers: list[str] = field(default_factory=list)
    forwards: list[tuple[int, float]] = field(default_factory=list)
    states_saved: list[int] = field(default_factory=list)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Both reports in one (TP ranks' reports are merged by vLLM)."""
        return WorkerReport(self.loads + other.loads, self.failed_peers + other.failed_peers,
                            self.forwards + other.forwards,
                            self.states_saved + other.states_saved)

    def is_empty(self) -> bool:
        return not (self.loads or self.failed_peers or self.forwards or self.states_saved)

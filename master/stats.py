"""The master's counters and the snapshot of them that readers get.

The loop thread bumps plain counters (:class:`OpCounters`, the loop and
snapshot timings in :class:`LoopStats`); nothing on the hot path locks.
Readers on other threads (``/metrics``, ``/health``) ask the server for a
:class:`MasterStats` snapshot, built by copying, and never touch the
directory or the server themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpool.core.protocol import SegmentInfo, StatsReply

__all__ = ["HaStandbyStats", "HaStats", "LoopStats", "MasterStats", "OpCounters", "copy_retrying"]

_T = TypeVar("_T")


@dataclass(slots=True)
class OpCounters:
    """Requests by op name, per-key operations, error results by (op, code name)."""

    ops: dict[str, int] = field(default_factory=dict)
    key_ops: dict[str, int] = field(default_factory=dict)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    too_many_requests: int = 0

    def error(self, op: str, code: str, n: int = 1) -> None:
        key = (op, code)
        self.errors[key] = self.errors.get(key, 0) + n


@dataclass(slots=True)
class LoopStats:
    """Timings of the event loop and of snapshots (written by the loop thread)."""

    max_loop_ms: float = 0.0
    snapshots: int = 0
    last_snapshot_pause_ms: float = 0.0  # wall time of the loop pause to start one
    last_snapshot_pause_cpu_ms: float = 0.0  # the same in loop-thread CPU time
    max_snapshot_step_ms: float = 0.0
    max_snapshot_step_cpu_ms: float = 0.0
    last_snapshot_duration_s: float = 0.0
    snapshot_in_progress: bool = False
    restored_objects: int = 0
    restore_s: float = 0.0  # the restart's restore, until serving began
    journal_seq: int | None = None


@dataclass(frozen=True, slots=True)
class HaStandbyStats:
    """One standby as the leader sees it."""

    instance_id: str
    state: str  # StandbyState value: "snapshot", "streaming", ...
    in_sync: bool
    acked_lsn: int
    lag: int  # records the leader holds that this standby has not acknowledged


@dataclass(frozen=True, slots=True)
class HaStats:
    """The HA state of one instance of a group (docs/ha.md), a copy made by
    ``HaNode.stats()``; ``/health`` and ``/metrics`` both render it.

    ``role`` is ``"leader"`` only while this instance serves a term whose
    lease is confirmed; a leader past its fencing deadline (``fenced``)
    reports ``"follower"`` (it acknowledges nothing). Leader-only fields are
    None / empty on a follower and the follower-only ones on a leader."""

    role: str  # "leader" / "follower"
    election: str  # Role value of the elector: "leader", "fenced", "follower"
    epoch: int
    instance_id: str
    eligible: bool
    leader: str | None  # the leader's address as etcd names it
    lsn: int  # the last log position this instance holds
    fenced: bool  # serving a term, but the lease is unconfirmed: no acknowledgments
    writes_refused: bool  # serving, but fenced or short of in-sync standbys: writes refused
    promotions: int
    demotions: int
    acked_lsn: int | None = None  # leader: held by every in-sync standby
    in_sync: int | None = None  # leader: in-sync standbys
    standbys: tuple[HaStandbyStats, ...] = ()  # leader
    sink: str | None = None  # follower: SinkState value
    applied_lsn: int | None = None  # follower: applied from the stream


@dataclass(frozen=True, slots=True)
class MasterStats:
    """A consistent-enough copy of every counter, for metrics and health."""

    stats: StatsReply
    segments: list[SegmentInfo]
    ops: dict[str, int]
    key_ops: dict[str, int]
    errors: dict[tuple[str, str], int]
    port: int
    events: dict[str, int] = field(default_factory=dict)  # EventPublisher.stats(); {} when off
    ha: HaStats | None = None  # None: not part of an HA group
    #: TenantTable.rows(): one dict per tenant (quotas, usage, counters)
    tenants: list[dict[str, Any]] = field(default_factory=list)


def copy_retrying(fn: Callable[[], _T], tries: int = 10) -> _T:
    """Run ``fn`` (reading loop-owned state from another thread), retrying if
    the loop changed a container under it."""
    for _ in range(tries):
        try:
            return fn()
        except (RuntimeError, IndexError, KeyError):  # e.g. dict changed size
            continue
    return fn()

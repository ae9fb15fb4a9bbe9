"""Load or recompute: per-request decisions from measured speeds.

The worker measures every load (bytes and seconds per peer: tier, transport,
host) and the forward passes it runs (prompt tokens and seconds); the
scheduler keeps moving averages of both (:class:`SpeedBook`) and decides per
request (:func:`decide`) how many of the stored leading chunks to load:

- a chunk costs ``bytes / throughput`` of its nearest replica's peer to load
  and ``tokens / prefill throughput`` to recompute; the scheduler loads the
  prefix with the largest saving (recompute minus load), nothing when no
  prefix saves time;
- a peer with no measurement yet, or whose last one is older than
  ``reprobe_s``, is probed: the load runs, bounded by a deadline that is a
  fraction (``probe_fraction``) of the recompute time, and measures it;
- a peer whose load failed or ran past its deadline is not loaded from for
  ``reprobe_s`` (then probed again);
- every load gets a deadline: at most ``load_timeout_s``, at most twice the
  predicted load time (plus a small slack) and the recompute time it saves,
  but at least 0.25 s (scheduling noise must not abandon loads on time). A
  load past its deadline is abandoned; its missing blocks are recomputed
  (vLLM's failed-load path, see LoadFailurePolicy).

Peer keys look like ``mem:local:hostA`` (memory segment on this host: shared
memory), ``mem:net:hostB`` (another host's memory, over TCP or RDMA),
``disk:local:hostA`` (a file segment: the SSD tier).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["ChunkCost", "Decision", "DecisionKind", "SpeedBook", "decide", "peer_key"]

_ALPHA = 0.3  # weight of a new sample in the moving averages
_MIN_LOAD_BYTES = 64 << 10  # smaller loads measure latency, not throughput
_MIN_PREFILL_TOKENS = 64  # smaller forwards measure decode, not prefill
_SLACK_S = 0.01  # deadline slack over 2x the predicted load time
# Shortest deadline: below this, scheduling noise on a busy host (GC, a
# preempted thread) would abandon loads that were on time; a misprediction
# costs at most this much on top of the recompute.
_MIN_DEADLINE_S = 0.25


def peer_key(kind: Any, same_host: bool, host_id: str) -> str:
    """``<tier>:<path>:<host>`` of a replica (see the module docstring)."""
    tier = "disk" if int(kind) == 1 else "mem"
    return f"{tier}:{'local' if same_host else 'net'}:{host_id}"


class DecisionKind(StrEnum):
    """What the scheduler chose for one request with a kvpool hit."""

    LOAD = "load"  # every found chunk
    PARTIAL = "partial"  # a leading part; the rest is computed
    RECOMPUTE = "recompute"  # nothing: computing is faster
    PROBE = "probe"  # no (fresh) measurement for a peer: bounded load
    AVOID = "avoid"  # a peer failed or overran recently: nothing loaded


@dataclass
class ChunkCost:
    """One stored chunk a request could load: its nearest replica's peer, the
    bytes this worker reads for it and the prompt tokens it covers."""

    peer: str
    nbytes: int
    tokens: int


@dataclass
class Decision:
    """``chunks`` leading chunks to load within ``deadline_s``."""

    kind: DecisionKind
    chunks: int
    deadline_s: float
    predicted_load_s: float | None = None
    predicted_recompute_s: float | None = None


@dataclass
class _Avg:
    value: float = 0.0
    n: int = 0
    at: float = 0.0  # monotonic time of the last sample

    def add(self, x: float, now: float) -> None:
        self.value = x if self.n == 0 else (1 - _ALPHA) * self.value + _ALPHA * x
        self.n += 1
        self.at = now


@dataclass
class SpeedBook:
    """Moving averages of load throughput per peer and of prefill throughput.
    Thread-safe. ``reprobe_s``: how long a measurement (or a failure) stands."""

    reprobe_s: float = 30.0
    _bw: dict[str, _Avg] = field(default_factory=dict)
    _avoid: dict[str, float] = field(default_factory=dict)  # peer -> until (monotonic)
    _prefill: _Avg = field(default_factory=_Avg)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_load(self, peer: str, nbytes: int, seconds: float) -> None:
        """A completed load of ``nbytes`` from ``peer`` in ``seconds``."""
        if nbytes < _MIN_LOAD_BYTES or seconds <= 0:
            return
        now = time.monotonic()
        with self._lock:
            self._bw.setdefault(peer, _Avg()).add(nbytes / seconds, now)
            self._avoid.pop(peer, None)

    def observe_failure(self, peer: str) -> None:
        """A load from ``peer`` failed or ran past its deadline: avoid it a while."""
        with self._lock:
            self._avoid[peer] = time.monotonic() + self.reprobe_s
            self._bw.pop(peer, None)  # its next load is a probe

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward pass computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens < _MIN_PREFILL_TOKENS or seconds <= 0:
            return
        with self._lock:
            self._prefill.add(tokens / seconds, time.monotonic())

    def bandwidth(self, peer: str) -> float | None:
        """Bytes/s expected from ``peer``; None when unmeasured or stale."""
        now = time.monotonic()
        with self._lock:
            a = self._bw.get(peer)
            if a is None or now - a.at > self.reprobe_s:
                return None
            return a.value

    def avoided(self, peer: str) -> bool:
        with self._lock:
            until = self._avoid.get(peer)
            if until is None:
                return False
            if time.monotonic() >= until:
                del self._avoid[peer]
                return False
            return True

    def prefill_tps(self) -> float | None:
        """Prompt tokens/s of this engine's forward passes; None before the first."""
        with self._lock:
            return self._prefill.value if self._prefill.n else None


def decide(book: SpeedBook, costs: list[ChunkCost], load_timeout_s: float,
           probe_fraction: float = 0.25) -> Decision:
    """How many of the leading chunks ``costs`` to load (see the module docstring)."""
    if not costs:
        return Decision(DecisionKind.RECOMPUTE, 0, 0.0)
    tps = book.prefill_tps()
    rec = [c.tokens / tps for c in costs] if tps else None
    # chunks before the first avoided peer are candidates
    n = len(costs)
    for i, c in enumerate(costs):
        if book.avoided(c.peer):
            n = i
            break
    if n == 0:
        return Decision(DecisionKind.AVOID, 0, 0.0, None, sum(rec) if rec else None)
    bws = [book.bandwidth(c.peer) for c in costs[:n]]
    if any(b is None for b in bws):
        # unmeasured peer: load, bounded by a fraction of the recompute time
        rec_n = sum(rec[:n]) if rec else None
        deadline = load_timeout_s if rec_n is None else min(
            load_timeout_s, max(_MIN_DEADLINE_S, probe_fraction * rec_n))
        return Decision(DecisionKind.PROBE, n, deadline, None, rec_n)
    loads = [c.nbytes / b for c, b in zip(costs[:n], bws, strict=True) if b]
    if rec is None:
        # no prefill measured yet: load what fits the timeout
        k, t = 0, 0.0
        while k < n and t + loads[k] <= load_timeout_s:
            t += loads[k]
            k += 1
        kind = DecisionKind.LOAD if k == len(costs) else (
            DecisionKind.PARTIAL if k else DecisionKind.RECOMPUTE)
        return Decision(kind, k, min(load_timeout_s, max(_MIN_DEADLINE_S, 2 * t + _SLACK_S)),
                        t, None)
    best_k, best_gain, cum_load, cum_rec = 0, 0.0, 0.0, 0.0
    for i in range(n):
        cum_load += loads[i]
        cum_rec += rec[i]
        if cum_load <= load_timeout_s and cum_rec - cum_load > best_gain:
            best_k, best_gain = i + 1, cum_rec - cum_load
    pred_load = sum(loads[:best_k])
    pred_rec = sum(rec[:best_k]) if best_k else sum(rec[:n])
    if best_k == 0:
        return Decision(DecisionKind.RECOMPUTE, 0, 0.0, sum(loads), pred_rec)
    kind = DecisionKind.LOAD if best_k == len(costs) else DecisionKind.PARTIAL
    deadline = min(load_timeout_s, max(_MIN_DEADLINE_S, min(2 * pred_load + _SLACK_S, pred_rec)))
    return Decision(kind, best_k, deadline, pred_load, pred_rec)

"""Transport selection: the loaded transports, the selector rules, health.

:class:`Transports` loads every transport the config names (a transport that
is unavailable here is skipped with its reason), answers which rule a request
falls under (remembered per segment kind, host, device and size) and which
transport it goes to next, and keeps each transport's health per peer: a
transport whose attempts towards a peer keep failing is paused towards that
peer for ``cooldown_s`` (a dead peer pauses tcp towards it only; a transport
broken everywhere ends up paused for every peer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.transfer.batch import SubBatch
from kvpool.transfer.config import RuleConfig, TransferConfig, TransportSettings
from kvpool.transfer.counters import Direction, OpCells, OpCounter, TransferCounters
from kvpool.transfer.transports import load_transport_class
from kvpool.transfer.transports.base import EngineContext, Transport
from kvpool.transfer.types import TransferError, TransferRequest

__all__ = ["TransportSlot", "Transports", "peer_key"]

log = logging.getLogger(__name__)

_RULE_CACHE = 4096  # (segment kind, same host, device, size) -> selector rule, remembered


class TransportSlot:
    """A loaded transport, its worker pool, its health per peer and the
    cells its slices are recorded in (``made``, by op)."""

    def __init__(self, transport: Transport, settings: TransportSettings,
                 made: OpCells | None = None) -> None:
        self.transport = transport
        self.settings = settings
        self.made: OpCells = made or (OpCounter(), OpCounter(), OpCounter())
        self.pool = ThreadPoolExecutor(max_workers=int(settings.threads),
                                       thread_name_prefix=f"kvpool-xfer-{transport.name}")
        # peer key -> [consecutive failed attempts, paused until (monotonic)]
        self.health: dict[str, list[float]] = {}

    def paused(self, peer: str) -> bool:
        h = self.health.get(peer)
        return h is not None and time.monotonic() < h[1]

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.transport.close()


def peer_key(item: TransferRequest) -> str:
    """Whom a request depends on besides the transport: the segment's owner."""
    seg = item.segment
    return seg.endpoint or f"{seg.host_id}/{seg.client_id}"


class Transports:
    """The transports of one engine and the selector over them (module docstring)."""

    def __init__(self, config: TransferConfig, counters: TransferCounters | None = None) -> None:
        self.config = config
        #: what the batches made on each transport (:mod:`kvpool.transfer.counters`)
        self.counters = counters or TransferCounters()
        self._lock = threading.Lock()
        self.slots: dict[str, TransportSlot] = {}
        self.unavailable: dict[str, str] = {}
        self._rule_cache: dict[tuple[SegmentKind, bool, str, int], RuleConfig | None] = {}
        # (segment kind, same host, device, size) -> the transports of its rule that are
        # loaded and support such a request, in order
        self._usable: dict[tuple[SegmentKind, bool, str, int], list[str]] = {}

    def load(self, ctx: EngineContext) -> None:
        """Load every transport the rules and ``transports`` section name.
        Raises ConfigError for one that is ``enabled: true`` but unavailable."""
        from kvpool.core.config import ConfigError

        names: list[str] = []
        for rule in self.config.rules:
            names += [t for t in rule.transports if t not in names]
        names += [t for t in self.config.transports if t not in names]
        for name in names:
            settings = self.config.settings_for(name)
            if settings.enabled is False:
                self.unavailable[name] = "disabled in config"
                continue
            cls, reason = load_transport_class(name)
            transport = cls(settings) if cls is not None else None
            if transport is not None:
                transport.attach(ctx)
                ok, reason = transport.available()
                if not ok:
                    transport.close()
                    transport = None
            if transport is None:
                if settings.enabled is True:
                    raise ConfigError(f"transport {name} is enabled: true but unavailable: "
                                      f"{reason}")
                self.unavailable[name] = reason
                log.info("transport %s skipped: %s", name, reason)
                continue
            self.slots[name] = TransportSlot(transport, settings,
                                             self.counters.cells(Direction.MADE, name))

    def register(self, transport: Transport, settings: TransportSettings | None,
                 ctx: EngineContext) -> None:
        """Add (or replace) a transport under ``transport.name``."""
        transport.attach(ctx)
        ok, reason = transport.available()
        if not ok:
            raise TransferError(f"transport {transport.name} unavailable: {reason}",
                                ErrorCode.TRANSPORT_UNAVAILABLE, retryable=False)
        with self._lock:
            old = self.slots.pop(transport.name, None)
            self.slots[transport.name] = TransportSlot(
                transport, settings or transport.settings,
                self.counters.cells(Direction.MADE, transport.name))
            self.unavailable.pop(transport.name, None)
            self._usable.clear()
        if old is not None:
            old.close()

    def states(self) -> dict[str, tuple[bool, str]]:
        """name -> (usable, reason) for every transport the config mentions."""
        out: dict[str, tuple[bool, str]] = {n: (True, "") for n in self.slots}
        out.update({n: (False, r) for n, r in self.unavailable.items()})
        return out

    def forget_segment(self, segment_id: str) -> None:
        """Every transport drops what it cached for ``segment_id``."""
        for slot in list(self.slots.values()):
            slot.transport.forget_segment(segment_id)

    def close(self) -> None:
        for slot in list(self.slots.values()):
            slot.close()
        self.slots.clear()

    # -- the selector -----------------------------------------------------------
    def rule_for(self, kind: SegmentKind, same_host: bool, device: str,
                 size: int) -> RuleConfig | None:
        """The first rule matching a request of this shape (None: none does)."""
        key = (kind, same_host, device, size)
        try:
            return self._rule_cache[key]
        except KeyError:
            pass
        found = None
        for rule in self.config.rules:
            if rule.matches(kind, same_host, device, size):
                found = rule
                break
        if len(self._rule_cache) >= _RULE_CACHE:
            self._rule_cache.clear()
        self._rule_cache[key] = found
        return found

    def candidates(self, item: TransferRequest) -> Sequence[str]:
        """The transports a resolved request may use, in order: the one it
        names, or its rule's. Raises TransferError when there is none."""
        if item.transport:
            if item.transport not in self.slots and item.transport not in self.unavailable \
                    and load_transport_class(item.transport)[0] is None:
                raise TransferError(f"unknown transport {item.transport!r}",
                                    ErrorCode.INVALID_PARAMS, retryable=False)
            return [item.transport]
        rule = self.rule_for(item.segment.kind, item.same_host, item.buffer.device, item.length)
        if rule is None:
            raise TransferError("no selector rule matches this request",
                                ErrorCode.TRANSPORT_UNAVAILABLE, retryable=False)
        return rule.transports

    def first_choice(self, item: TransferRequest) -> str:
        """The transport a resolved request goes to first: the one it names,
        or the first of its rule's that is loaded, supports it and is not
        paused towards its peer. Raises TransferError when there is none
        (INVALID_PARAMS for an unknown named one, TRANSPORT_UNAVAILABLE with
        the reasons otherwise)."""
        if not item.transport:
            key = (item.segment.kind, item.same_host, item.buffer.device, item.length)
            usable = self._usable.get(key)
            if usable is None:
                candidates = self.candidates(item)
                usable = [n for n in candidates if n in self.slots
                          and self.slots[n].transport.supports(key[0], key[1], key[2])]
                if len(self._usable) >= _RULE_CACHE:
                    self._usable.clear()
                self._usable[key] = usable
            for name in usable:
                slot = self.slots.get(name)
                if slot is not None and not (slot.health and slot.paused(peer_key(item))):
                    return name
        found, why = self.next_transport(item, self.candidates(item), ())
        if found is None:
            raise TransferError(f"no usable transport: {why}", ErrorCode.TRANSPORT_UNAVAILABLE,
                                retryable=False)
        return found

    def next_transport(self, item: TransferRequest, candidates: Sequence[str],
                       tried: Sequence[str]) -> tuple[str | None, str]:
        """The first of ``candidates`` not in ``tried`` that is loaded,
        supports the item and is not paused towards its peer: ``(name, "")``,
        or ``(None, why none)``."""
        why: list[str] = []
        for name in candidates:
            if name in tried:
                continue
            slot = self.slots.get(name)
            if slot is None:
                why.append(f"{name}: {self.unavailable.get(name, 'not loaded')}")
                continue
            if not slot.transport.supports(item.segment.kind, item.same_host, item.device):
                detail = ""
                if item.device == "cuda":
                    from kvpool.transfer.gpu import cuda_runtime

                    detail = f" ({cuda_runtime()[1]})" if cuda_runtime()[0] is None else ""
                why.append(f"{name}: does not support this request{detail}")
                continue
            if slot.health and slot.paused(peer_key(item)):
                why.append(f"{name}: paused after repeated failures towards this peer")
                continue
            return name, ""
        return None, "; ".join(why) or "no transport left"

    def update_health(self, slot: TransportSlot, sb: SubBatch,
                      failures: list[tuple[TransferRequest, TransferError]]) -> None:
        """After a sub-batch: per peer, an attempt counts against the
        transport only if nothing got through to that peer and a failure was
        the transport's (a bounds or permission refusal is final and says
        nothing of its health); enough in a row pause it towards that peer."""
        if not failures and not slot.health:
            return
        failed_peers = {peer_key(it) for it, e in failures if e.retryable}
        failed_items = {it.index for it, _ in failures}
        ok_peers = {peer_key(it) for it in sb.items if it.index not in failed_items}
        with self._lock:
            for peer in ok_peers:
                h = slot.health.get(peer)
                if h is not None:
                    h[0] = 0
            for peer in failed_peers - ok_peers:
                h = slot.health.setdefault(peer, [0, 0.0])
                h[0] += 1
                if h[0] >= slot.settings.pause_after_failures:
                    h[0] = 0
                    h[1] = time.monotonic() + slot.settings.cooldown_s
                    log.warning("transport %s paused for %.1fs towards %s after repeated "
                                "failures", sb.transport, slot.settings.cooldown_s, peer)


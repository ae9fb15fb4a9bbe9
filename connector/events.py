"""KV events for cache-aware routers: what the pool holds, in vLLM's block hashes.

vLLM publishes KV cache events (``--kv-events-config``: BlockStored /
BlockRemoved with a ``medium``) that routers (llm-d's KV cache manager,
vLLM's router, Dynamo) use to send a request to the engine that holds its
prefix. The connector adds kvpool's blocks to that stream
(``take_events``), in vLLM's own block hashes so a router matches them like
the engine's GPU blocks:

- ``BlockStored`` with medium ``KVPOOL_DRAM`` for the blocks of every chunk
  this engine saves, and, at lookup, for chunks found in the pool that this
  engine has not announced yet (stored by another engine: this one can load
  them too); medium ``KVPOOL_DISK`` when the nearest replica is on the SSD
  tier.
- ``BlockRemoved`` (same medium) when a lookup no longer finds a chunk this
  engine announced (evicted or removed).

Announced chunks are remembered in a bounded LRU (``max_chunks``); vLLM
computes block hashes only with prefix caching on, so without it no event
is produced. Events are plain tuples here; :mod:`kvpool.connector.vllm`
turns them into vLLM's event classes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["Medium", "PoolEvent", "PoolEvents"]


class Medium(StrEnum):
    """The ``medium`` of kvpool's blocks in vLLM's KV events (one per tier)."""

    DRAM = "KVPOOL_DRAM"
    DISK = "KVPOOL_DISK"


@dataclass(frozen=True)
class PoolEvent:
    """One event: ``stored`` (else removed) blocks of one chunk."""

    stored: bool
    block_hashes: tuple[Any, ...]
    medium: Medium
    parent_block_hash: Any = None
    token_ids: tuple[int, ...] = ()


class PoolEvents:
    """Events not yet taken, and the chunks announced (LRU). Thread-safe."""

    def __init__(self, max_chunks: int = 100_000) -> None:
        self.max_chunks = max_chunks
        self._known: OrderedDict[str, tuple[tuple[Any, ...], Medium]] = OrderedDict()
        self._queue: list[PoolEvent] = []
        self._lock = threading.Lock()

    def stored(self, chunk_hash: str, block_hashes: Sequence[Any], parent: Any,
               token_ids: Sequence[int], medium: Medium) -> None:
        """Announce a chunk (once while it stays known; again if its tier changed)."""
        if not block_hashes:
            return
        with self._lock:
            old = self._known.get(chunk_hash)
            if old is not None and old[1] == medium:
                self._known.move_to_end(chunk_hash)
                return
            if old is not None:  # moved between tiers: removed from the old one
                self._queue.append(PoolEvent(False, old[0], old[1]))
            hashes = tuple(block_hashes)
            self._known[chunk_hash] = (hashes, medium)
            self._queue.append(PoolEvent(True, hashes, medium, parent, tuple(token_ids)))
            while len(self._known) > self.max_chunks:
                self._known.popitem(last=False)  # forgotten, not removed: no event

    def missing(self, chunk_hash: str) -> None:
        """A lookup did not find an announced chunk: announce its removal."""
        with self._lock:
            old = self._known.pop(chunk_hash, None)
            if old is not None:
                self._queue.append(PoolEvent(False, old[0], old[1]))

    def known(self, chunk_hash: str) -> bool:
        with self._lock:
            return chunk_hash in self._known

    def take(self) -> list[PoolEvent]:
        """Events since the last call, in order."""
        with self._lock:
            out, self._queue = self._queue, []
        return out

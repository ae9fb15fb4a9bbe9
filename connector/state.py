"""Recurrent state (Mamba / linear attention) between vLLM's state blocks and
pool objects.

A hybrid model such as Qwen3-Next keeps, beside its attention KV, one state
per sequence in each linear-attention layer. vLLM (``mamba_cache_mode=
"align"``) checkpoints that state at block boundaries into a block of the
layer's state group; a prefix can be resumed only where a state exists.
kvpool stores such a checkpoint as one object per layer and rank
(:meth:`kvpool.connector.keys.KeySpace.state_key`), straight from the
block's bytes (no staging copy on a host: a state block is one contiguous
range), and reads it back straight into the block a hit gets.

A load succeeds only when every layer's object arrived whole: a prefix
whose state is missing must be recomputed, never resumed from a block
holding another sequence's state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvpool.connector.keys import KeySpace
from kvpool.connector.layout import LayerLayout
from kvpool.connector.metadata import StateRef
from kvpool.connector.store_access import StoreAccess, put_from_ready
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode

__all__ = ["StateCache"]

log = logging.getLogger("kvpool.connector")


class StateCache:
    """The state layers of one worker: per state group, its layers' blocks.

    ``groups[s]``: the layers of state group ``s`` in model order (their
    tensors' dim 0 = blocks, each block one contiguous range). ``rank`` of
    ``ranks``: this worker's tensor-parallel rank (its objects' key)."""

    def __init__(self, groups: Sequence[Sequence[tuple[str, Any]]], keys: KeySpace,
                 store: StoreAccess, rank: int = 0, ranks: int = 1) -> None:
        self.keys = keys
        self.store = store
        self.rank = rank
        self.ranks = ranks
        self.groups: list[list[LayerLayout]] = [
            [LayerLayout.from_tensor(name, j, t) for j, (name, t) in enumerate(layers)]
            for layers in groups]
        if not all(self.groups):
            raise ConfigError("a state group without layers")
        self.num_blocks = min(lay.num_blocks for g in self.groups for lay in g)

    def _objects(self, refs: Sequence[StateRef]) -> tuple[list[str], list[Any], list[int]]:
        """Keys, block views and sizes of every object of ``refs``."""
        keys: list[str] = []
        views: list[Any] = []
        sizes: list[int] = []
        for r in refs:
            if not 0 <= r.group < len(self.groups):
                raise ConfigError(f"state group {r.group} of {len(self.groups)}")
            if not 0 <= r.block_id < self.num_blocks:
                raise ConfigError(f"state block {r.block_id} outside 0..{self.num_blocks - 1}")
            for lay in self.groups[r.group]:
                keys.append(self.keys.state_key(r.hash, r.group, lay.index, self.rank,
                                                self.ranks))
                views.append(lay.blocks[r.block_id])
                sizes.append(lay.block_bytes)
        return keys, views, sizes

    def save(self, refs: Sequence[StateRef], config: Any = None) -> tuple[int, int, int, int]:
        """Put the objects of ``refs`` from their blocks (the forward that
        wrote them has finished). Returns (states written, states already
        stored, states that failed, bytes written); a state counts as written
        when every object of it is stored and one was new. Never raises for
        store trouble."""
        if not refs:
            return 0, 0, 0, 0
        keys, views, sizes = self._objects(refs)
        try:
            codes = [ErrorCode(int(c)) for c in self.store.call(
                partial(put_from_ready, keys=keys, bufs=views, config=config))]
        except Exception as exc:  # saving is best effort
            log.warning("kvpool: state save failed: %r", exc)
            return 0, 0, len(refs), 0
        new = have = failed = nbytes = 0
        at = 0
        for r in refs:
            n = len(self.groups[r.group])
            mine = codes[at : at + n]
            nbytes += sum(sz for c, sz in zip(mine, sizes[at : at + n], strict=True)
                          if c == ErrorCode.OK)
            at += n
            if any(c not in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS) for c in mine):
                failed += 1
            elif ErrorCode.OK in mine:
                new += 1
            else:
                have += 1
        return new, have, failed, nbytes

    def load(self, refs: Sequence[StateRef]) -> tuple[bool, int]:
        """Read the objects of ``refs`` into their blocks. Returns (every
        object arrived whole, bytes read); a block id of -1 or any missing
        object is a failed load. Never raises for store trouble."""
        if not refs:
            return True, 0
        if any(r.block_id < 0 for r in refs):
            return False, 0
        keys, views, sizes = self._objects(refs)
        try:
            got = self.store.call(lambda c: list(c.batch_get_into(keys, views)))
        except Exception as exc:  # a failed load is recomputed
            log.warning("kvpool: state load failed: %r", exc)
            return False, 0
        ok = all(int(n) == size for n, size in zip(got, sizes, strict=True))
        return ok, sum(sizes) if ok else 0

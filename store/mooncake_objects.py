"""The one write and the one staged read of the Mooncake-compatible store.

Every Mooncake call that stores whole objects (bytes, parts, multi-buffers,
tensors, their upsert forms) ends in :meth:`ObjectIO.write`: one master RPC
and one transfer batch for all keys of the call, each key's object the
concatenation of its parts. Every call that returns objects in buffers the
store allocates (``get_buffer``, ``get_batch``, tensor reads) ends in
:meth:`ObjectIO.read`. Both apply Mooncake's ``local_buffer_size`` limit
where Mooncake stages (``staged``), and return Mooncake's results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store._bufutil import buffer_nbytes
from kvpool.store.client import Location, RangeRead, parts_checksum_ok
from kvpool.store.config import ReplicateConfig
from kvpool.store.mooncake_codes import INVALID, code_of, log, mooncake_code, put_codes
from kvpool.store.mooncake_core import MooncakeCore, pick_groups
from kvpool.store.mooncake_types import BufferHandle

__all__ = ["ObjectIO"]

_ONE = {1}


class ObjectIO:
    """Whole-object writes and staged reads of one store (module docstring)."""

    def __init__(self, core: MooncakeCore) -> None:
        self._core = core

    def write(self, keys: Sequence[str], parts: Sequence[Sequence[Any] | None],
              config: ReplicateConfig | None, *, staged: bool,
              upsert: bool = False) -> list[int]:
        """Store each key's object as the concatenation of its ``parts`` (a key
        whose parts are None is refused with INVALID_PARAMS and left out, its
        ``group_ids`` entry too). Per key 0 (also for an existing key with a
        put: value kept) or a Mooncake code; every key the same code when the
        call as a whole fails (not set up, bad config or key, over
        ``local_buffer_size`` when ``staged``).

        ``upsert``: insert or replace. A replaced object stays readable,
        unchanged, until the new one is committed; its space is freed once
        the read leases on it have ended. Its hard pin carries over; its soft
        pin too unless the config says ENABLE (a new pin) or DISABLE; its
        object group cannot change (-600). A key given twice in one call ends
        with its last value.
        """
        core, n = self._core, len(keys)
        try:
            cfg = core.config(config, n)
            client = core.live()
            pool_keys = core.keys(keys)
            todo = [i for i, ps in enumerate(parts) if ps is not None]
            given = cast("Sequence[Sequence[Any]]", parts)  # at the positions in todo
            if staged and not core.fits_staging(
                    sum(buffer_nbytes(p) for i in todo for p in given[i])):
                return [INVALID] * n
        except KVPoolError as exc:
            return [code_of(exc)] * n
        out = [INVALID] * n
        while todo:
            round_cfg = cfg if len(todo) == n else pick_groups(cfg, todo)
            round_keys = [pool_keys[i] for i in todo]
            round_parts = [given[i] for i in todo]
            try:
                if set(map(len, round_parts)) == _ONE:  # one buffer each: the direct path
                    codes = client.batch_put_from(round_keys, [ps[0] for ps in round_parts],
                                                  round_cfg, upsert=upsert)
                else:
                    codes = client.batch_put_parts(round_keys, round_parts, round_cfg,
                                                   upsert=upsert)
            except KVPoolError as exc:
                code = code_of(exc)
                for i in todo:
                    out[i] = code
                break
            if not upsert:
                for i, c in zip(todo, put_codes(codes), strict=True):
                    out[i] = c
                break
            again: list[int] = []
            for i, c in zip(todo, codes, strict=True):
                # only a key repeated in the batch is refused as existing: its
                # later occurrences go in the next round (the last value wins)
                if c == ErrorCode.OBJECT_ALREADY_EXISTS:
                    again.append(i)
                else:
                    out[i] = mooncake_code(c)
            todo = again
        return out

    def read(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """Each key's object in a new :class:`BufferHandle`, None where missing,
        unreadable or failing its checksum; every key None when the objects
        found exceed ``local_buffer_size`` together. One master RPC, one
        transfer batch."""
        core = self._core
        client = core.client
        out: list[BufferHandle | None] = [None] * len(keys)
        if client is None or not keys:
            return out
        valid = core.valid_keys(keys)
        try:
            locs = client.batch_locate([k for _, k in valid])
            found = [(i, loc) for (i, _k), loc in zip(valid, locs, strict=True)
                     if loc.code == ErrorCode.OK]
            if not core.fits_staging(sum(loc.size for _, loc in found)):
                return out
            bufs = {i: BufferHandle(loc.size) for i, loc in found}
            got = client.read_ranges([RangeRead(loc, bufs[i], 0, loc.size) for i, loc in found])
        except KVPoolError as exc:
            log.debug("read of %d keys: %s", len(keys), exc)
            return out
        verify = client.config.verify_checksum
        for (i, loc), n in zip(found, got, strict=True):
            if n == loc.size and (not verify or _checksum_ok(loc, bufs[i])):
                out[i] = bufs[i]
        return out


def _checksum_ok(loc: Location, buf: Any) -> bool:
    return not loc.checksum or parts_checksum_ok(loc.checksum, [buf], loc.size) is not False

"""Queries and removals: the store client's calls that move no bytes.

Each is one master call. Batch forms check keys on the client and answer per
key (an invalid key is INVALID_KEY without a round trip; ``batch_exists``,
which answers booleans, raises StoreError(INVALID_KEY) for one instead);
single-key forms raise the error of their code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    BatchExist,
    BatchRemove,
    BatchReplicaClear,
    CreateCopyTask,
    CreateMoveTask,
    Exist,
    GetSize,
    ListSegments,
    QueryTask,
    QueryTaskReply,
    Remove,
    RemoveAll,
    RemoveByRegex,
    SegmentInfo,
    Stats,
    StatsReply,
)
from kvpool.store.errors import ObjectNotFound, StoreError
from kvpool.store.reads import code_of, valid_key
from kvpool.store.session import MasterSession

__all__ = ["Admin", "checked_key", "split_valid"]


def checked_key(key: Any) -> str:
    """``key``, or StoreError(INVALID_KEY) when it cannot name an object."""
    if not valid_key(key):
        raise StoreError(f"invalid key {key!r}", ErrorCode.INVALID_KEY)
    return str(key)


def split_valid(keys: Sequence[str]) -> tuple[list[int], list[ErrorCode]]:
    """The positions of the valid keys, and per key OK or INVALID_KEY."""
    codes = [ErrorCode.OK] * len(keys)
    valid = []
    for i, k in enumerate(keys):
        if valid_key(k):
            valid.append(i)
        else:
            codes[i] = ErrorCode.INVALID_KEY
    return valid, codes


class Admin:
    """Queries, removals and replica tasks of one client (module docstring)."""

    def __init__(self, session: MasterSession) -> None:
        self.session = session

    def exists(self, key: str) -> bool:
        """True when ``key`` has a complete replica (grants a read lease)."""
        try:
            return self.session.call(Exist(checked_key(key))).exists
        except ObjectNotFound:
            return False

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` for many keys in one call ([] for []); an invalid
        key raises StoreError(INVALID_KEY)."""
        self.session.check()
        if not keys:
            return []
        for k in keys:
            checked_key(k)
        res = self.session.call(BatchExist(list(keys)))
        return [not code and found for code, found in zip(res.codes, res.exists, strict=True)]

    def get_size(self, key: str) -> int:
        return self.session.call(GetSize(checked_key(key))).size

    def remove(self, key: str, force: bool = False) -> None:
        self.session.call(Remove(checked_key(key), bool(force)))

    def remove_all(self, force: bool = False) -> int:
        return self.session.call(RemoveAll(bool(force))).removed

    def remove_by_regex(self, pattern: str, force: bool = False, prefix: str = "",
                        exclude_prefix: str = "") -> int:
        return self.session.call(RemoveByRegex(pattern, bool(force), prefix,
                                               exclude_prefix)).removed

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        """Per key OK, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE or INVALID_KEY."""
        self.session.check()
        valid, codes = split_valid(keys)
        if valid:
            res = self.session.call(BatchRemove([keys[i] for i in valid], bool(force)))
            for i, code in zip(valid, res.codes, strict=True):
                codes[i] = code_of(code)
        return codes

    def batch_replica_clear(self, keys: Sequence[str], segment_id: str = "") -> list[ErrorCode]:
        """Per key OK, PERMISSION_DENIED, OBJECT_HAS_LEASE, OBJECT_NOT_FOUND or
        INVALID_KEY."""
        self.session.check()
        valid, codes = split_valid(keys)
        if valid:
            res = self.session.call(BatchReplicaClear(self.session.client_id,
                                                      [keys[i] for i in valid], segment_id))
            for i, code in zip(valid, res.codes, strict=True):
                codes[i] = code_of(code)
        return codes

    def stats(self) -> StatsReply:
        return self.session.call(Stats())

    def list_segments(self) -> list[SegmentInfo]:
        return self.session.call(ListSegments()).segments

    def create_copy_task(self, key: str, targets: Sequence[str]) -> int:
        return self.session.call(CreateCopyTask(checked_key(key), list(targets))).task_id

    def create_move_task(self, key: str, source: str, target: str) -> int:
        return self.session.call(CreateMoveTask(checked_key(key), source, target)).task_id

    def query_task(self, task_id: int) -> QueryTaskReply:
        return self.session.call(QueryTask(int(task_id)))

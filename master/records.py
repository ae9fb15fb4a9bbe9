"""Journal records: the directory's changes as typed msgspec Structs.

Every change a client is told about is one record: the journal writes it
(group commit), the HA leader ships it, a restart or a standby applies it
(:meth:`kvpool.master.replay.Replay.apply`, the one place records are
applied), the event stream translates it. A record is a
``msgspec.Struct(array_like=True, tag=N)``, which encodes as the positional
array ``[N, field, ...]`` journals have always held: data dirs written
before stay readable, and the bytes written are the same.

Journal frames are decoded straight into these types (:func:`decode_frame`);
a record that does not fit its type is kept as the raw list it was, which
applying reports as a failure (a bad record is logged and skipped, the rest
applies).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

__all__ = [
    "Changes",
    "DirRecord",
    "DropReplica",
    "DropSegment",
    "JournalRecord",
    "Mount",
    "Put",
    "Rec",
    "Record",
    "Remove",
    "SetQuota",
    "StreamPos",
    "decode_frame",
]


class Rec(IntEnum):
    """Journal record tags (the first item of each record's array)."""

    MOUNT = 1
    DROP_SEGMENT = 2
    PUT = 3
    REMOVE = 4
    DROP_REPLICA = 5
    TENANT_SET = 6
    #: a standby's position in the leader's log (journal only, never shipped)
    STREAM_POS = 101


class Record(msgspec.Struct, array_like=True, gc=False):
    """A journal record; ``rec[i]`` reads it as its wire array (``rec[0]``:
    the tag), for logs and for readers of the positional form."""

    def __getitem__(self, i: Any) -> Any:
        return (type(self).__struct_config__.tag, *msgspec.structs.astuple(self))[i]


class Mount(Record, tag=int(Rec.MOUNT)):
    """A segment was mounted or re-adopted: its descriptor's wire map."""

    segment: dict[str, Any]


class DropSegment(Record, tag=int(Rec.DROP_SEGMENT)):
    """A segment is gone (unmount, expiry, owner never returned) with its replicas."""

    segment_id: str


class Put(Record, tag=int(Rec.PUT)):
    """An object's whole replica set: a new object, an upsert, a tier move.
    ``replicas``: ``[segment_id, offset, segment_id, offset, ...]``."""

    key: str
    size: int
    flags: int
    checksum: Any
    replicas: list[Any]


class Remove(Record, tag=int(Rec.REMOVE)):
    """An object is gone (remove, clear, eviction of its last replica)."""

    key: str


class DropReplica(Record, tag=int(Rec.DROP_REPLICA)):
    """One replica of an object is gone (eviction or clear of one tier's copy)."""

    key: str
    segment_id: str


class SetQuota(Record, tag=int(Rec.TENANT_SET)):
    """A tenant's quotas were set live (TENANT_SET): bytes, -1 = unlimited/none."""

    name: str
    memory: int
    disk: int
    guaranteed: int


class StreamPos(Record, tag=int(Rec.STREAM_POS)):
    """A standby's place in the leader's log after the records before it.
    ``history``: ``[[epoch, first_lsn], ...]``, None when unchanged since the
    last one (:mod:`kvpool.master.durability`)."""

    epoch: int
    lsn: int
    history: list[list[int]] | None


#: what the directory emits and applies
DirRecord = Mount | DropSegment | Put | Remove | DropReplica | SetQuota
#: what a journal file holds
JournalRecord = DirRecord | StreamPos

_decode_batch = msgspec.msgpack.Decoder(list[JournalRecord]).decode
_decode_one = msgspec.msgpack.Decoder(JournalRecord).decode
_decode_any = msgspec.msgpack.Decoder().decode
_ARRAY16, _ARRAY32 = 0xDC, 0xDD


def _is_batch(payload: bytes | memoryview) -> bool:
    """Whether the array ``payload`` holds starts with an array (a batch of
    records) rather than an int (one record, as older journals framed them)."""
    head = payload[0]
    at = 1 if 0x90 <= head <= 0x9F else 3 if head == _ARRAY16 else 5 if head == _ARRAY32 else -1
    if at < 0 or at >= len(payload):
        return False
    first = payload[at]
    return 0x90 <= first <= 0x9F or first in (_ARRAY16, _ARRAY32)


def decode_frame(payload: bytes | memoryview) -> list[Any]:
    """The records of one journal frame (a batch, or one record). Raises
    ``msgspec.DecodeError`` on bytes that are not msgpack; a record that is
    msgpack but not a valid record stays the raw value it decoded to."""
    batch = _is_batch(payload)
    try:
        return _decode_batch(payload) if batch else [_decode_one(payload)]
    except msgspec.ValidationError:
        raw = _decode_any(payload)
    out: list[Any] = []
    for rec in (raw if batch else [raw]):
        try:
            out.append(msgspec.convert(rec, JournalRecord))
        except (msgspec.ValidationError, TypeError):
            out.append(rec)
    return out


class Changes:
    """The records of the changes made since the last commit (the server
    journals them before it replies, :meth:`Durability.commit`), and whether
    changes are recorded at all (off while replaying: a restore, a standby)."""

    __slots__ = ("journaling", "records")

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.journaling = True

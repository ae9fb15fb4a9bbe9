"""Typed headers of the transfer server (ZeroMQ) and of its bulk path (plain TCP).

Both ends encode and decode these msgspec Structs; the decoder checks every
field's type, so no header reaches the servers' logic with a missing or
mistyped field: such a header is ``MALFORMED_FRAME``. The checks that need the
server's state (segment owned here, op allowed, range inside the segment, size
limit, capability) stay in the servers.

**Transfer server** (ZeroMQ ROUTER; :mod:`kvpool.transfer.server`). One header
frame, a msgpack *map* (:class:`ServerRequest`: ``op``, ``id``, ``seg``,
``off``, ``len``, ``cap``), then the payload frame of a WRITE. Replies are
:class:`ServerReply` maps (``id``, ``code``, ``err``), :class:`BulkOffer` for
``op`` :attr:`ServerOp.BULK` and :class:`StatsReply` for :attr:`ServerOp.STATS`.
Maps, not arrays: the server also answers hand-written and fuzzed frames by
field name.

**Bulk path** (:mod:`kvpool.transfer.bulk`). A stream of ``[u32 LE header
length][msgpack array header]`` messages. A :class:`BulkRequest` carries one op
and up to a header's worth of :class:`BulkItem` ranges; an item's capability is
either the token itself or, towards a server whose :class:`BulkOffer` says
``caps``, the index of a token in the request's ``caps`` table (a per-batch
token covers every range of a batch: sent once, not once per item); a WRITE is followed by
the payloads of all its items back to back, a READ by nothing. The answer is a
:class:`BulkReply` with one code per item, followed (READ) by the payloads of
the items whose code is OK, back to back. Many small requests thus cost one
header, one syscall per direction and one round trip.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "BULK_FRAME_HEADER",
    "BulkItem",
    "BulkOffer",
    "BulkReply",
    "BulkRequest",
    "ServerOp",
    "ServerReply",
    "ServerRequest",
    "StatsReply",
    "bulk_hint",
    "decode_bulk_reply",
    "decode_bulk_request",
    "decode_reply",
    "decode_request",
    "encode",
    "request_id",
]

#: bytes of the little-endian length prefix of every bulk-path header
BULK_FRAME_HEADER = 4


class ServerOp(IntEnum):
    """Ops of the transfer server's header (READ and WRITE are TransferOp's values)."""

    READ = 1
    WRITE = 2
    PING = 3
    STATS = 4
    BULK = 5  # -> BulkOffer: the bulk path's port and limits


class ServerRequest(msgspec.Struct, omit_defaults=True, gc=False):
    """One transfer-server request: ``len`` bytes at ``off`` of segment ``seg``
    (usable-region offsets), with the capability ``cap`` the owner may verify.
    PING / STATS / BULK carry only ``op`` and ``id``."""

    op: int
    id: int | None = None
    seg: str = ""
    off: int = 0
    len: int = 0
    cap: bytes = b""


class ServerReply(msgspec.Struct, gc=False):
    """The answer to one request; ``id`` echoes the request's (None when its
    header was unreadable), ``code`` an :class:`ErrorCode` value, ``err`` why."""

    id: int | None
    code: int
    err: str = ""


class BulkOffer(ServerReply, gc=False):
    """Answer to ``ServerOp.BULK``: the bulk path's ``bulk`` port (0 = none),
    the largest single range ``max`` and the largest header ``hdr`` it takes."""

    bulk: int = 0
    max: int = 0
    hdr: int = 0
    caps: bool = False  # takes BulkRequest.caps (items name a token by index)


class StatsReply(ServerReply, gc=False):
    """Answer to ``ServerOp.STATS``: the server's counters."""

    stats: dict[str, Any] = msgspec.field(default_factory=dict)


class BulkItem(msgspec.Struct, array_like=True, gc=False):
    """One range of a bulk request: ``len`` bytes at ``off`` of segment ``seg``;
    ``cap`` the capability token, or its index in :attr:`BulkRequest.caps`."""

    seg: str
    off: int
    len: int
    cap: bytes | int = b""


class BulkRequest(msgspec.Struct, array_like=True, gc=False):
    """``op`` (READ or WRITE) on every item, in order; ``pad`` is ignored (it
    keeps short frames at a minimum size, see :mod:`kvpool.transfer.bulk`);
    ``caps``: the tokens items name by index (only towards a server that
    offers it; an index outside the table refuses that item, MALFORMED_FRAME)."""

    id: int
    op: int
    items: list[BulkItem]
    pad: bytes = b""
    caps: list[bytes] = msgspec.field(default_factory=list)


class BulkReply(msgspec.Struct, array_like=True, gc=False):
    """One :class:`ErrorCode` value per item of request ``id``; ``err`` says why
    the first refused item was refused; ``pad`` is ignored."""

    id: int
    codes: list[int]
    err: str = ""
    pad: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_req_decoder = msgspec.msgpack.Decoder(ServerRequest)
_rep_decoder = msgspec.msgpack.Decoder(ServerReply)
_offer_decoder = msgspec.msgpack.Decoder(BulkOffer)
_bulk_req_decoder = msgspec.msgpack.Decoder(BulkRequest)
_bulk_rep_decoder = msgspec.msgpack.Decoder(BulkReply)


class _IdOnly(msgspec.Struct, gc=False):
    id: int | None = None


_id_decoder = msgspec.msgpack.Decoder(_IdOnly)


def encode(msg: msgspec.Struct) -> bytes:
    """The msgpack bytes of one header."""
    return _encoder.encode(msg)


def _malformed(what: str, exc: Exception) -> KVPoolError:
    return KVPoolError(f"malformed {what}: {exc}", ErrorCode.MALFORMED_FRAME)


def decode_request(data: bytes | memoryview) -> ServerRequest:
    """A transfer-server request header; MALFORMED_FRAME if it is not one."""
    try:
        return _req_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _malformed("request header", exc) from exc


def request_id(data: bytes | memoryview) -> int | None:
    """The ``id`` of a request header that did not decode, when it has a readable one."""
    try:
        return _id_decoder.decode(data).id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_reply(data: bytes | memoryview, offer: bool = False) -> ServerReply:
    """A transfer-server reply (``offer``: the answer to ``ServerOp.BULK``)."""
    try:
        return (_offer_decoder if offer else _rep_decoder).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _malformed("reply header", exc) from exc


def bulk_hint(extra: Any) -> BulkOffer | None:
    """The bulk offer a segment descriptor's ``extra["bulk"]`` publishes (the
    owner's transfer server puts ``{"bulk", "max", "hdr", "caps"}`` there, as
    :class:`BulkOffer` has them), or None when there is none or it does not
    parse (the peer is then asked with ``ServerOp.BULK``)."""
    hint = extra.get("bulk") if isinstance(extra, dict) else None
    if not isinstance(hint, dict):
        return None
    try:
        offer = msgspec.convert({"id": 0, "code": 0, **hint}, BulkOffer)
    except (msgspec.ValidationError, TypeError):
        return None
    return offer if 0 < offer.bulk < 65536 and offer.max > 0 else None


def decode_bulk_request(data: bytes | memoryview) -> BulkRequest:
    """A bulk-path request header; MALFORMED_FRAME if it is not one."""
    try:
        return _bulk_req_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _malformed("bulk request header", exc) from exc


def decode_bulk_reply(data: bytes | memoryview) -> BulkReply:
    """A bulk-path reply header; MALFORMED_FRAME if it is not one."""
    try:
        return _bulk_rep_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _malformed("bulk reply header", exc) from exc

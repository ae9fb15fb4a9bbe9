"""Framing and codec of the master's RPC, and the op table it dispatches on.

:class:`Op` numbers the ops; every op has a request type (a :class:`Request`
parametrised with its reply type) and a reply type (a :class:`Reply`), msgspec
Structs encoded as msgpack arrays in field order. :func:`register` enters a
request type into :data:`OPS`; the op Structs themselves are in
:mod:`kvpool.core.ops` (imported at the end of this module, so the table is
whole wherever the codec is used). The server decodes a request straight into
its Struct, so the schema *is* the argument check: a wrong type, a missing
field or a wrong count is an ``INVALID_PARAMS`` error (``INVALID_KEY`` when
the bad field is a key), never a crash.

Framing (the same bytes over ZeroMQ and over the direct sockets of
:mod:`kvpool.master.local_rpc`, where each frame is prefixed with its length
as ``LOCAL_FRAME_HEADER`` bytes little-endian)::

    request  [op: int, id: int, args: <the op's request Struct>]
    reply    [id: int | nil, code: int(ErrorCode), result: <reply Struct> | nil, error: str]

Every request and reply of every master call passes through here: the
encoders and decoders are built once, and a call does no more than one
msgspec encode or decode per frame. :mod:`kvpool.core.protocol` re-exports
every name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Generic, TypeVar

import msgpack
import msgspec

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "LOCAL_FRAME_HEADER",
    "OPS",
    "Empty",
    "Op",
    "OpSpec",
    "Reply",
    "ReplyFrame",
    "Request",
    "RequestFrame",
    "decode_frame",
    "decode_reply",
    "decode_request",
    "encode_error",
    "encode_frame",
    "encode_reply",
    "encode_request",
    "peek_id",
    "register",
]

#: Same-host framing (master/local_rpc.py): each payload is prefixed with its
#: length as this many bytes, little-endian.
LOCAL_FRAME_HEADER = 4

R = TypeVar("R", bound="Reply")


class Op(IntEnum):
    """The op codes (the first element of a request frame)."""

    PING = 1
    MOUNT_SEGMENT = 2
    UNMOUNT_SEGMENT = 3
    PUT_START = 10
    PUT_END = 11
    PUT_REVOKE = 12
    GET_REPLICA_LIST = 13
    EXIST = 14
    GET_SIZE = 15
    REMOVE = 16
    REMOVE_ALL = 17
    REMOVE_BY_REGEX = 18
    UPSERT_START = 19
    PUT_COMMIT = 20
    BATCH_PUT_START = 30
    BATCH_PUT_END = 31
    BATCH_PUT_REVOKE = 32
    BATCH_GET_REPLICA_LIST = 33
    BATCH_EXIST = 34
    BATCH_GET_SIZE = 35
    BATCH_REMOVE = 36
    BATCH_UPSERT_START = 37
    BATCH_REPLICA_CLEAR = 38
    BATCH_PUT_COMMIT = 39
    STATS = 50
    LIST_SEGMENTS = 51
    GET_SEGMENTS = 52
    LOCAL_ENDPOINT = 53
    TIER_TASK_DONE = 60
    LIST_OBJECTS = 70
    CREATE_COPY_TASK = 80
    CREATE_MOVE_TASK = 81
    QUERY_TASK = 82
    TENANT_SET = 90
    TENANT_LIST = 91


# ------------------------------------------------------------------ base types


class Request(msgspec.Struct, Generic[R], array_like=True, omit_defaults=True, gc=False):
    """Base of every request. ``OP`` is set by :func:`register`."""

    OP: ClassVar[Op]


class Reply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every reply."""


class Empty(Reply):
    """The reply of ops that return nothing but their code."""


@dataclass(frozen=True)
class OpSpec:
    """One row of the op table."""

    op: Op
    request: type[Request[Any]]
    reply: type[Reply]
    summary: str
    request_decoder: msgspec.msgpack.Decoder[Any]
    reply_decoder: msgspec.msgpack.Decoder[Any]

    @property
    def handler_name(self) -> str:
        """The method of ``master.handlers.OpHandlers`` that serves this op."""
        return self.op.name.lower()


#: The op table: Op -> request type, reply type, summary.
OPS: dict[Op, OpSpec] = {}
_T = TypeVar("_T", bound=type[Request[Any]])


def register(op: Op, reply: type[Reply], summary: str) -> Any:
    """Class decorator: make the decorated request type ``op``'s request."""

    def deco(cls: _T) -> _T:
        if op in OPS:
            raise ValueError(f"{op.name} registered twice")
        cls.OP = op
        OPS[op] = OpSpec(op, cls, reply, summary, msgspec.msgpack.Decoder(cls),
                         msgspec.msgpack.Decoder(reply))
        return cls

    return deco


# ------------------------------------------------------------------ framing


class RequestFrame(msgspec.Struct, array_like=True, gc=False):
    """A decoded request envelope; ``args`` is still encoded (decoded with the
    op's request type once the op is known)."""

    op: int
    id: int
    args: msgspec.Raw


class ReplyFrame(msgspec.Struct, array_like=True, gc=False):
    """A decoded reply envelope; ``result`` is still encoded (decode it with
    the op's reply type)."""

    id: int | None
    code: int
    result: msgspec.Raw
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode
_request_frame = msgspec.msgpack.Decoder(RequestFrame).decode
_reply_frame = msgspec.msgpack.Decoder(ReplyFrame).decode
_FIELD_AT = re.compile(r"at `\$\[(\d+)\]")
_KEY_FIELDS = frozenset({"key", "keys"})


def encode_request(rid: int, req: Request[Any]) -> bytes:
    """The request frame for ``req`` (its op from the op table)."""
    return _encode((req.OP, rid, req))


def encode_reply(rid: int, result: Reply) -> bytes:
    """A successful reply frame."""
    return _encode((rid, 0, result, ""))


def encode_error(rid: int | None, code: ErrorCode | int, message: str) -> bytes:
    """An error reply frame."""
    return _encode((rid, int(code), None, message))


def _bad_frame(payload: bytes | memoryview, exc: Exception) -> KVPoolError:
    return KVPoolError(f"malformed frame: {exc}", ErrorCode.MALFORMED_FRAME)


def peek_id(payload: bytes | memoryview) -> int | None:
    """The request id of a frame that failed to decode whole (None if unreadable)."""
    try:
        return _request_frame(payload).id
    except Exception:
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception:
            return None
        if isinstance(obj, list | tuple) and len(obj) >= 2 and type(obj[1]) is int:
            return int(obj[1])
        return None


def decode_request(payload: bytes | memoryview,
                   max_size: int | None = None) -> tuple[int, OpSpec, Request[Any]]:
    """``(id, spec, request)`` of a request frame.

    Raises KVPoolError: FRAME_TOO_LARGE, MALFORMED_FRAME (not a request
    frame), UNKNOWN_OP, INVALID_KEY (a key field of a wrong type) or
    INVALID_PARAMS (any other field). The id is in ``exc.request_id`` when
    it could be read.
    """
    if max_size is not None and len(payload) > max_size:
        err = KVPoolError(f"frame of {len(payload)} bytes exceeds {max_size}",
                          ErrorCode.FRAME_TOO_LARGE)
        err.request_id = peek_id(payload)  # type: ignore[attr-defined]
        raise err
    try:
        frame = _request_frame(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        err = _bad_frame(payload, exc)
        err.request_id = None  # type: ignore[attr-defined]
        raise err from None
    spec = OPS.get(frame.op)  # type: ignore[call-overload]
    if spec is None:
        err = KVPoolError(f"unknown op {frame.op}", ErrorCode.UNKNOWN_OP)
        err.request_id = frame.id  # type: ignore[attr-defined]
        raise err
    try:
        req = spec.request_decoder.decode(frame.args)
    except msgspec.ValidationError as exc:
        err = KVPoolError(str(exc), _validation_code(spec.request, str(exc)))
        err.request_id = frame.id  # type: ignore[attr-defined]
        raise err from None
    except msgspec.DecodeError as exc:
        err = _bad_frame(payload, exc)
        err.request_id = frame.id  # type: ignore[attr-defined]
        raise err from None
    return frame.id, spec, req


def _validation_code(cls: type[msgspec.Struct], message: str) -> ErrorCode:
    """INVALID_KEY when the field that failed is a key (``key``/``keys``)."""
    m = _FIELD_AT.search(message)
    if m is not None:
        i = int(m.group(1))
        fields = cls.__struct_fields__
        if i < len(fields) and fields[i] in _KEY_FIELDS:
            return ErrorCode.INVALID_KEY
    return ErrorCode.INVALID_PARAMS


def decode_reply(payload: bytes | memoryview) -> ReplyFrame:
    """The reply envelope (MALFORMED_FRAME if it is not one)."""
    try:
        return _reply_frame(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVPoolError(f"malformed reply: {exc}", ErrorCode.MALFORMED_FRAME) from None


# Untyped msgpack frames, for the transfer server's headers (their own schema).
def encode_frame(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_frame(data: bytes | memoryview, max_size: int | None = None) -> Any:
    """Decode one msgpack frame; raise MALFORMED_FRAME on anything invalid."""
    if max_size is not None and len(data) > max_size:
        raise KVPoolError(
            f"frame of {len(data)} bytes exceeds {max_size}", ErrorCode.FRAME_TOO_LARGE
        )
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types on garbage input
        raise KVPoolError(f"malformed frame: {exc}", ErrorCode.MALFORMED_FRAME) from exc


# the op Structs register themselves into OPS (an import cycle by design: kvpool.core.ops
# needs the base types above)
import kvpool.core.ops  # noqa: E402, F401

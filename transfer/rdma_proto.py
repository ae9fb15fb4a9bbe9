"""QP-info exchange of the ``rdma`` transport (msgpack, through the peer's
transfer server or the transport's own connect listener).

Request (one header frame, like every transfer-server request)::

    {"op": 16 (OP_RDMA_CONNECT), "id": int, "v": 1,
     "conn": str   requester's connection id (<= 64 chars; a reconnect with the
                   same id replaces the old responder QPs),
     "host": str   requester's host id,
     "qps":  [[qp_num, psn, lid, gid, mtu], ...]   requester QPs ([] = only query segments),
     "segs": [segment_id, ...]}                    segments whose MR info is wanted

Reply::

    {"id": int, "code": int(ErrorCode), "err": str,
     "qps":  [[qp_num, psn, lid, gid, mtu], ...]   responder QPs, same order, already RTS
     "segs": [[segment_id, addr, rkey, length], ...]}

``qp_num``/``psn`` are 24-bit, ``lid`` 16-bit, ``gid`` pyverbs' text form
(``xxxx:`` x8), ``mtu`` the port's active MTU in bytes (the path uses the
smaller of both ends). ``addr`` is the absolute address of the segment's first
usable byte in the owner's address space (what RDMA READ/WRITE target) and
``length`` its usable size. The messages are msgspec Structs with their bounds
as field constraints, converted from the decoded maps; what a type cannot say
(GID form, MTU value, reachability, 64-bit address overflow) is checked after.
A bad field is ``KVPoolError(MALFORMED_FRAME)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer.rdma_verbs import MTU_BYTES, RemoteQp, valid_gid

__all__ = [
    "MAX_QPS_PER_CONNECT",
    "MAX_SEGMENTS_PER_CONNECT",
    "OP_RDMA_CONNECT",
    "PROTO_VERSION",
    "ConnectReply",
    "ConnectRequest",
    "QpInfo",
    "SegmentMr",
]

OP_RDMA_CONNECT = 16
PROTO_VERSION = 1
MAX_QPS_PER_CONNECT = 16
#: bounded so a request header stays below the transfer server's 4 KiB header limit
MAX_SEGMENTS_PER_CONNECT = 32
_U24 = (1 << 24) - 1
_U16 = (1 << 16) - 1
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_T = TypeVar("_T")


def _bad(msg: str) -> KVPoolError:
    return KVPoolError(f"rdma connect: {msg}", ErrorCode.MALFORMED_FRAME)


def _convert(value: Any, typ: type[_T]) -> _T:
    """``value`` (decoded msgpack) as ``typ``; MALFORMED_FRAME when it does not fit."""
    try:
        return msgspec.convert(value, typ, strict=True)
    except msgspec.ValidationError as exc:
        raise _bad(str(exc)) from None


class QpInfo(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One QP end: what the other side's RTR transition needs."""

    qp_num: Annotated[int, Meta(ge=1, le=_U24)]
    psn: Annotated[int, Meta(ge=0, le=_U24)]
    lid: Annotated[int, Meta(ge=0, le=_U16)]
    gid: str
    mtu: int

    def validate(self) -> QpInfo:
        """The checks a type cannot state: GID form, MTU value, reachability."""
        if not valid_gid(self.gid):
            raise _bad(f"gid {self.gid!r} is not xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx")
        if self.mtu not in MTU_BYTES.values():
            raise _bad(f"mtu {self.mtu!r} not in {sorted(MTU_BYTES.values())}")
        if self.lid == 0 and self.gid == "0000:0000:0000:0000:0000:0000:0000:0000":
            raise _bad("neither a LID nor a GID: the QP is unreachable")
        return self

    def to_wire(self) -> list[Any]:
        return [self.qp_num, self.psn, self.lid, self.gid, self.mtu]

    @classmethod
    def from_wire(cls, v: Any) -> QpInfo:
        return _convert(v, cls).validate()

    def remote(self) -> RemoteQp:
        return RemoteQp(self.qp_num, self.psn, self.lid, self.gid, self.mtu)


class SegmentMr(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A segment's registration as peers target it."""

    segment_id: Annotated[str, Meta(max_length=256)]
    addr: Annotated[int, Meta(ge=1)]  # msgspec ints end at 2**64 - 1
    rkey: Annotated[int, Meta(ge=0, le=_U32)]
    length: Annotated[int, Meta(ge=0)]

    def validate(self) -> SegmentMr:
        if self.addr + self.length > _U64:
            raise _bad(f"segment {self.segment_id!r}: addr + length beyond 64 bits")
        return self

    def to_wire(self) -> list[Any]:
        return [self.segment_id, self.addr, self.rkey, self.length]

    @classmethod
    def from_wire(cls, v: Any) -> SegmentMr:
        return _convert(v, cls).validate()

    def to_extra(self, connect: str) -> dict[str, Any]:
        """The ``SegmentDescriptor.extra["rdma"]`` form (plus the connect endpoint)."""
        return {"addr": self.addr, "rkey": self.rkey, "len": self.length, "connect": connect}

    @classmethod
    def from_extra(cls, segment_id: str, extra: Any) -> SegmentMr:
        if not isinstance(extra, dict):
            raise _bad("descriptor extra['rdma'] must be a map")
        return cls.from_wire([segment_id, extra.get("addr"), extra.get("rkey"),
                              extra.get("len")])


_Conn = Annotated[str, Meta(min_length=1, max_length=64)]
_Str = Annotated[str, Meta(max_length=256)]
_Id = Annotated[int, Meta(ge=0)]  # msgspec ints end at 2**64 - 1


class _RequestWire(msgspec.Struct, gc=False):
    """The request map as it travels (``op`` and ``v`` are checked first)."""

    op: int
    v: int
    conn: _Conn
    id: _Id = 0
    host: _Str = ""
    qps: Annotated[list[QpInfo], Meta(max_length=MAX_QPS_PER_CONNECT)] = \
        msgspec.field(default_factory=list)
    segs: Annotated[list[_Str], Meta(max_length=MAX_SEGMENTS_PER_CONNECT)] = \
        msgspec.field(default_factory=list)


class _ReplyWire(msgspec.Struct, gc=False):
    """A successful reply map as it travels."""

    id: _Id
    code: int
    err: str = ""
    qps: Annotated[list[QpInfo], Meta(max_length=MAX_QPS_PER_CONNECT)] = \
        msgspec.field(default_factory=list)
    segs: Annotated[list[SegmentMr], Meta(max_length=MAX_SEGMENTS_PER_CONNECT)] = \
        msgspec.field(default_factory=list)


@dataclass(slots=True)
class ConnectRequest:
    conn: str
    host: str
    qps: list[QpInfo] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    id: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"op": OP_RDMA_CONNECT, "id": self.id, "v": PROTO_VERSION, "conn": self.conn,
                "host": self.host, "qps": [q.to_wire() for q in self.qps],
                "segs": list(self.segments)}

    @classmethod
    def from_wire(cls, d: Any) -> ConnectRequest:
        if not isinstance(d, dict):
            raise _bad("request is not a map")
        if d.get("op") != OP_RDMA_CONNECT:
            raise _bad(f"op {d.get('op')!r} is not OP_RDMA_CONNECT")
        if d.get("v") != PROTO_VERSION:
            raise KVPoolError(f"rdma connect: protocol version {d.get('v')!r} "
                              f"(this side speaks {PROTO_VERSION})", ErrorCode.INVALID_VERSION)
        w = _convert(d, _RequestWire)
        if w.id > _U64:  # decoded msgpack cannot exceed it; a converted Python int can
            raise _bad(f"id {w.id} beyond 64 bits")
        for q in w.qps:
            q.validate()
        if not w.qps and not w.segs:
            raise _bad("nothing asked: no qps and no segments")
        return cls(w.conn, w.host, w.qps, w.segs, w.id)


@dataclass(slots=True)
class ConnectReply:
    id: int = 0
    code: ErrorCode = ErrorCode.OK
    err: str = ""
    qps: list[QpInfo] = field(default_factory=list)
    segments: list[SegmentMr] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "code": int(self.code), "err": self.err,
                "qps": [q.to_wire() for q in self.qps],
                "segs": [s.to_wire() for s in self.segments]}

    @classmethod
    def from_wire(cls, d: Any) -> ConnectReply:
        if not isinstance(d, dict):
            raise _bad("reply is not a map")
        rid = d.get("id")
        code_v = d.get("code")
        if not isinstance(code_v, int) or isinstance(code_v, bool):
            raise _bad("reply has no integer code")
        try:
            code = ErrorCode(code_v)
        except ValueError:
            code = ErrorCode.INTERNAL_ERROR
        if code != ErrorCode.OK:
            return cls(rid if isinstance(rid, int) else 0, code, str(d.get("err", "")))
        w = _convert(d, _ReplyWire)
        if w.id > _U64:
            raise _bad(f"id {w.id} beyond 64 bits")
        for q in w.qps:
            q.validate()
        for sm in w.segs:
            sm.validate()
        return cls(w.id, code, w.err, w.qps, w.segs)

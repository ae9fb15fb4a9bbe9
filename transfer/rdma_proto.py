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
``length`` its usable size. Everything is validated on decode; a bad field is
``KVPoolError(MALFORMED_FRAME)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def _bad(msg: str) -> KVPoolError:
    return KVPoolError(f"rdma connect: {msg}", ErrorCode.MALFORMED_FRAME)


def _int(v: Any, name: str, hi: int, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _bad(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(v: Any, name: str, max_len: int = 256) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise _bad(f"{name} must be a string of at most {max_len} chars")
    return v


def _list(v: Any, name: str, max_len: int) -> list[Any]:
    if not isinstance(v, list | tuple) or len(v) > max_len:
        raise _bad(f"{name} must be a list of at most {max_len} entries")
    return list(v)


@dataclass(frozen=True, slots=True)
class QpInfo:
    """One QP end: what the other side's RTR transition needs."""

    qp_num: int
    psn: int
    lid: int
    gid: str
    mtu: int

    def validate(self) -> QpInfo:
        _int(self.qp_num, "qp_num", _U24, 1)
        _int(self.psn, "psn", _U24)
        _int(self.lid, "lid", _U16)
        if not isinstance(self.gid, str) or not valid_gid(self.gid):
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
        f = _list(v, "qp entry", 5)
        if len(f) != 5:
            raise _bad("qp entry must be [qp_num, psn, lid, gid, mtu]")
        return cls(f[0], f[1], f[2], f[3], f[4]).validate()

    def remote(self) -> RemoteQp:
        return RemoteQp(self.qp_num, self.psn, self.lid, self.gid, self.mtu)


@dataclass(frozen=True, slots=True)
class SegmentMr:
    """A segment's registration as peers target it."""

    segment_id: str
    addr: int
    rkey: int
    length: int

    def validate(self) -> SegmentMr:
        _str(self.segment_id, "segment_id")
        _int(self.addr, "addr", _U64, 1)
        _int(self.rkey, "rkey", _U32)
        _int(self.length, "length", _U64 - self.addr)
        return self

    def to_wire(self) -> list[Any]:
        return [self.segment_id, self.addr, self.rkey, self.length]

    @classmethod
    def from_wire(cls, v: Any) -> SegmentMr:
        f = _list(v, "segment entry", 4)
        if len(f) != 4:
            raise _bad("segment entry must be [segment_id, addr, rkey, length]")
        return cls(f[0], f[1], f[2], f[3]).validate()

    def to_extra(self, connect: str) -> dict[str, Any]:
        """The ``SegmentDescriptor.extra["rdma"]`` form (plus the connect endpoint)."""
        return {"addr": self.addr, "rkey": self.rkey, "len": self.length, "connect": connect}

    @classmethod
    def from_extra(cls, segment_id: str, extra: Any) -> SegmentMr:
        if not isinstance(extra, dict):
            raise _bad("descriptor extra['rdma'] must be a map")
        addr: Any = extra.get("addr")
        rkey: Any = extra.get("rkey")
        length: Any = extra.get("len")
        return cls(segment_id, addr, rkey, length).validate()


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
        rid = _int(d.get("id", 0), "id", _U64)
        conn = _str(d.get("conn"), "conn", 64)
        if not conn:
            raise _bad("conn must not be empty")
        host = _str(d.get("host", ""), "host")
        qps = [QpInfo.from_wire(q) for q in _list(d.get("qps", []), "qps",
                                                   MAX_QPS_PER_CONNECT)]
        segs = [_str(s, "segment id") for s in _list(d.get("segs", []), "segs",
                                                      MAX_SEGMENTS_PER_CONNECT)]
        if not qps and not segs:
            raise _bad("nothing asked: no qps and no segments")
        return cls(conn, host, qps, segs, rid)


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
        if not isinstance(code_v, int):
            raise _bad("reply has no integer code")
        try:
            code = ErrorCode(code_v)
        except ValueError:
            code = ErrorCode.INTERNAL_ERROR
        err = str(d.get("err", ""))
        if code != ErrorCode.OK:
            return cls(rid if isinstance(rid, int) else 0, code, err)
        qps = [QpInfo.from_wire(q) for q in _list(d.get("qps", []), "qps",
                                                   MAX_QPS_PER_CONNECT)]
        segs = [SegmentMr.from_wire(s) for s in _list(d.get("segs", []), "segs",
                                                       MAX_SEGMENTS_PER_CONNECT)]
        return cls(_int(rid, "id", _U64), code, err, qps, segs)

"""The master's op handlers: request Struct in, reply Struct out, no sockets.

:class:`OpHandlers` serves every op of :data:`kvpool.core.protocol.OPS`
against a :class:`~kvpool.master.directory.Directory`: each op by the
method named after it (``Op.BATCH_PUT_START`` -> ``batch_put_start``) of
one of its groups, each a room of its own: :class:`WriteOps` (puts,
commits, reservations, revokes), :class:`ReadOps` (replica lists, exist,
sizes), :class:`SegmentOps` (ping, mounts, segments, tier tasks),
:class:`AdminOps` (removal, listing, stats) and :class:`TenantOps` (tenant
quotas). A handler takes the decoded
request and returns the reply or raises :class:`KVPoolError`.
:meth:`OpHandlers.handle_payload` is the whole request path (decode, run,
encode, count) as bytes in, bytes out: the event loop calls it for ZeroMQ
and Unix-socket frames alike, and tests call it without any socket.

Directory changes are appended to ``directory.records``; the caller
commits them (durability) before it sends the replies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvpool.core.capability import CapabilitySigner
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    OPS,
    Reply,
    Request,
    decode_request,
    encode_error,
    encode_reply,
    peek_id,
)
from kvpool.master.admin_ops import AdminOps
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.op_group import ServerInfo
from kvpool.master.read_ops import ReadOps
from kvpool.master.segment_ops import SegmentOps
from kvpool.master.stats import OpCounters
from kvpool.master.tenant_ops import TenantOps
from kvpool.master.tiering import TieringPolicy
from kvpool.master.write_ops import WriteOps

__all__ = ["OpHandlers", "ServerInfo"]

log = logging.getLogger(__name__)


class OpHandlers:
    """Every op of the table, socket-free (see the module docstring)."""

    def __init__(self, cfg: MasterConfig, directory: Directory, tiering: TieringPolicy,
                 signer: CapabilitySigner | None, info: ServerInfo | None = None) -> None:
        self.cfg = cfg
        self.dir = directory
        self.tiering = tiering
        self.signer = signer
        self.info = info or ServerInfo()
        self.counters = OpCounters()
        self.max_frame = cfg.max_frame_size
        args = (cfg, directory, tiering, signer, self.info, self.counters)
        self.writes = WriteOps(*args)
        self.reads = ReadOps(*args)
        self.segments = SegmentOps(*args)
        self.admin = AdminOps(*args)
        self.tenants = TenantOps(*args)
        groups = (self.writes, self.reads, self.segments, self.admin, self.tenants)
        self._run: dict[int, tuple[str, Callable[[Any], Reply]]] = {}
        for op, spec in OPS.items():
            fns = [fn for g in groups if (fn := getattr(g, spec.handler_name, None))]
            if len(fns) != 1:
                raise TypeError(f"{len(fns)} handlers {spec.handler_name!r} for {op.name}")
            self._run[int(op)] = (op.name, fns[0])

    def handle(self, req: Request[Any]) -> Reply:
        """Run one decoded request (counted); raises KVPoolError on an error."""
        name, fn = self._run[req.OP]
        ops = self.counters.ops
        ops[name] = ops.get(name, 0) + 1
        return fn(req)

    def handle_payload(self, payload: bytes) -> bytes:
        """Decode one request frame, run it, encode the reply. Never raises."""
        rid: int | None = None
        name = "invalid"
        try:
            rid, spec, req = decode_request(payload, self.max_frame)
            name, fn = self._run[spec.op]
            ops = self.counters.ops
            ops[name] = ops.get(name, 0) + 1
            return encode_reply(rid, fn(req))
        except KVPoolError as exc:
            code = exc.code
            text = str(exc)
            rid = getattr(exc, "request_id", rid)
            if code == ErrorCode.UNKNOWN_OP:
                name = "unknown"
        except Exception as exc:  # a bug: answer and keep serving
            log.exception("internal error handling %s", name)
            code = ErrorCode.INTERNAL_ERROR
            text = f"{type(exc).__name__}: {exc}"
        self.counters.error(name, code.name)
        return encode_error(rid, code, text[:1000])

    def too_many(self, payload: bytes) -> bytes:
        """The reply to a request beyond ``max_inflight_per_client`` (not run)."""
        c = self.counters
        c.too_many_requests += 1
        c.error("invalid", ErrorCode.TOO_MANY_REQUESTS.name)
        return encode_error(
            peek_id(payload), ErrorCode.TOO_MANY_REQUESTS,
            f"more than {self.cfg.max_inflight_per_client} requests queued on this "
            "connection; wait for replies before sending more")

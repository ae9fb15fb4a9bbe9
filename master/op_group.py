"""What every group of op handlers shares: the directory, the configuration,
the counters, the grants and the argument checks the schema cannot make
(key length, batch length, client ids), who may act as which tenant
(``tenant_keys``), the tenant scope of a request's
keys (:class:`~kvpool.master.keys.Scopes`: each handler maps the caller's
keys to the stored ones through ``self.scope(req.tenant)`` before the
directory sees them, and stored keys back before a reply shows them), and
what the handlers learn from the process around them (:class:`ServerInfo`).

The schema (:mod:`kvpool.core.protocol`) has already checked every type;
a per-key error of a batch is a code in its reply, a whole-request error
(and any error of a single-key op) a :class:`KVPoolError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.capability import CapabilitySigner
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory, write_grant_ms
from kvpool.master.grants import Granter
from kvpool.master.keys import Scopes, check_key
from kvpool.master.parked import ParkedPings
from kvpool.master.stats import LoopStats, OpCounters
from kvpool.master.tiering import TieringPolicy

__all__ = ["OpGroup", "ServerInfo", "bad"]

_INVALID_KEY = int(ErrorCode.INVALID_KEY)
_CODE_NAMES = {int(c): c.name for c in ErrorCode}


def bad(msg: str, code: ErrorCode = ErrorCode.INVALID_PARAMS) -> KVPoolError:
    """The error of a request the master refuses as a whole."""
    return KVPoolError(msg, code)


class ServerInfo:
    """What the handlers learn from the process around them (the event loop,
    durability, the admin endpoints). Defaults serve a socket-free test."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.loop = LoopStats()
        #: persist the capability keys before a MOUNT reply hands one out
        self.save_keys: Callable[[], None] = lambda: None
        #: (path, instance, tcp_port) of the direct RPC sockets, or None
        self.local_endpoint: Callable[[], tuple[str, str, int] | None] = lambda: None
        #: requests / connections served over the same-host socket
        self.local_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.curve = False
        self.curve_denied: Callable[[], int] = lambda: 0
        #: the CURVE public key (z85 text) of the connection whose request runs
        #: now; None: unknown (no CURVE, the same-host socket). Set by the event
        #: loop only when ``tenant_keys`` is configured.
        self.peer: str | None = None
        #: (stream, seq, epoch) of a tenant's event stream (kvpool.master.events,
        #: by canonical tenant name); zeros when off
        self.events_position: Callable[[str], tuple[int, int, int]] = lambda t: (0, 0, 0)
        #: the serving loop's held PINGs (kvpool.master.parked); None: none held
        self.parked: ParkedPings | None = None


def _tenant_guard(cfg: MasterConfig, info: ServerInfo) -> Callable[[str], None]:
    """The check of ``tenant_keys``: the connection of the request running
    now (``info.peer``) must hold a key listed for the tenant it names."""
    allowed = cfg.tenant_key_sets()

    def guard(tenant: str) -> None:
        keys = allowed.get(tenant)
        if keys is None or info.peer not in keys:
            raise KVPoolError(f"this connection may not act as tenant {tenant!r} (its CURVE "
                              "key is not listed for it in tenant_keys)",
                              ErrorCode.PERMISSION_DENIED)

    return guard


class OpGroup:
    """The base of each group of handlers (one method per op, named after it)."""

    def __init__(self, cfg: MasterConfig, directory: Directory, tiering: TieringPolicy,
                 signer: CapabilitySigner | None, info: ServerInfo,
                 counters: OpCounters) -> None:
        self.cfg = cfg
        self.dir = directory
        self.tiering = tiering
        self.signer = signer
        self.info = info
        self.counters = counters
        self.max_key = cfg.max_key_length
        self.scopes = Scopes(cfg.max_key_length,
                             guard=_tenant_guard(cfg, info) if cfg.tenant_keys else None)
        #: a request's tenant field -> its Scope (the one place keys are scoped;
        #: a bound method: cheaper to call than the instance)
        self.scope = self.scopes.of
        self.max_batch = cfg.max_batch_size
        # READ grants last a read lease; the directory holds revoked space as
        # long as a WRITE grant lasts
        ttl = cfg.capability_ttl_ms or cfg.lease_ttl_ms
        self.granter = Granter(signer, signer.ttl_ms if signer is not None else ttl,
                               write_grant_ms(cfg))

    def count(self, name: str, codes: Sequence[int]) -> None:
        """Count a batch's key-ops and its per-key errors."""
        key_ops = self.counters.key_ops
        key_ops[name] = key_ops.get(name, 0) + len(codes)
        if any(codes):
            err = self.counters.error
            for c in codes:
                if c:
                    err(name, _CODE_NAMES.get(c, str(c)))

    def count_one(self, name: str, n: int = 1) -> None:
        """Count ``n`` key-ops without errors."""
        key_ops = self.counters.key_ops
        key_ops[name] = key_ops.get(name, 0) + n

    def check_batch(self, keys: Sequence[Any]) -> None:
        if len(keys) > self.max_batch:
            raise bad(f"batch of {len(keys)} exceeds max_batch_size {self.max_batch}")

    @staticmethod
    def check_client(client_id: str) -> str:
        if not client_id:
            raise bad("client_id must be a non-empty string")
        return client_id

    def fail(self, code: int, what: str, key: str = "") -> None:
        """Raise the error of a single-key op's ``code`` (nothing when OK)."""
        if code:
            if code == _INVALID_KEY:
                check_key(key, self.max_key)
            raise KVPoolError(what, code)

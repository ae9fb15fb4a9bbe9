"""etcd v3 for kvpool: a small client over etcd's JSON gateway, and the
leader resolver that clients use to find a master group's leader.

Why the gateway and the standard library (docs/ha.md has the numbers): etcd
serves its v3 API as JSON over HTTP/1.1 on the client port (``/v3/kv/range``,
``/v3/kv/txn``, ``/v3/lease/*``, streaming ``/v3/watch``). Over a kept-alive
``http.client`` connection a range or a keepalive costs ~0.2-0.4 ms on
loopback, a few times a gRPC client's, which is irrelevant at the rates kvpool
uses etcd (a keepalive every few hundred ms, a txn per leader term). In
exchange: no grpcio/protobuf dependency in every client process (the maintained
gRPC clients pin protobuf ranges that collide with vLLM's), no gRPC threads
(fork-safety), and every call bounded by one socket timeout that we choose,
which the fencing deadline of :mod:`kvpool.master.ha.election` relies on.

Addresses: a master group is named ``etcd://HOST:PORT[;HOST:PORT...][/CLUSTER_ID]``
(Mooncake's form; ``,`` separates endpoints too; the cluster id defaults to
``default``). Keys of a group live under ``/kvpool/<cluster_id>/``:

- ``leader``: the campaign key, held by the leader's lease. Its value is a
  JSON :class:`LeaderInfo`; its ``create_revision`` is the term's **epoch**
  (etcd revisions only grow, and every term creates the key anew).
- ``members/<instance_id>``: every instance, held by its own lease (JSON
  :class:`MemberInfo`), so ``kvpool status`` can list followers too.
- ``sync``: the leader's in-sync standby set (master-only; see
  :mod:`kvpool.master.ha.election`).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "DEFAULT_CLUSTER_ID",
    "Compare",
    "CompareTarget",
    "DeleteOp",
    "EtcdClient",
    "EtcdError",
    "EtcdTarget",
    "EventType",
    "KeyValue",
    "LeaderInfo",
    "LeaderResolver",
    "MemberInfo",
    "PutOp",
    "RangeOp",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "group_keys",
    "is_etcd_url",
    "parse_etcd_url",
    "policy_address",
    "shared_resolver",
]

log = logging.getLogger(__name__)

DEFAULT_CLUSTER_ID = "default"
ROOT = "/kvpool"
_SCHEME = "etcd://"


# ================================================================ addresses
@dataclass(frozen=True)
class EtcdTarget:
    """A parsed ``etcd://`` address: etcd endpoints and the group's cluster id."""

    endpoints: tuple[str, ...]
    cluster_id: str = DEFAULT_CLUSTER_ID

    def url(self) -> str:
        return f"{_SCHEME}{';'.join(self.endpoints)}/{self.cluster_id}"


def is_etcd_url(address: str) -> bool:
    return address.strip().lower().startswith(_SCHEME)


def _check_endpoint(ep: str) -> str:
    ep = ep.strip()
    if ep.startswith(("http://", "https://")):
        if ep.startswith("https://"):
            raise ValueError(f"etcd endpoint {ep!r}: TLS endpoints are not supported")
        ep = ep[len("http://"):]
    host, sep, port = ep.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {ep!r} must be HOST:PORT")
    return ep


def parse_etcd_url(address: str, cluster_id: str | None = None) -> EtcdTarget:
    """``etcd://h1:p1;h2:p2/ID`` (``,`` also separates) -> :class:`EtcdTarget`.

    A bare ``h1:p1,h2:p2`` list (the master's ``--etcd`` flag) is accepted too;
    ``cluster_id`` overrides the URL's. Raises ValueError on a malformed address."""
    rest = address.strip()
    if rest.lower().startswith(_SCHEME):
        rest = rest[len(_SCHEME):]
    path_id = ""
    if "/" in rest:
        rest, path_id = rest.split("/", 1)
        path_id = path_id.strip("/")
    eps = tuple(_check_endpoint(e) for e in rest.replace(",", ";").split(";") if e.strip())
    if not eps:
        raise ValueError(f"no etcd endpoint in {address!r}")
    cid = cluster_id or path_id or DEFAULT_CLUSTER_ID
    if "/" in cid or not cid.isprintable() or len(cid) > 128:
        raise ValueError(f"bad cluster id {cid!r}")
    return EtcdTarget(eps, cid)


def policy_address(address: str) -> str:
    """The address to base network decisions on (CURVE policy, the local bind
    address): a master group's first etcd endpoint as ``tcp://HOST:PORT``
    (the group's instances run on that network), any other address as is."""
    if is_etcd_url(address):
        return "tcp://" + parse_etcd_url(address).endpoints[0]
    return address


@dataclass(frozen=True)
class GroupKeys:
    """The etcd keys of one master group."""

    prefix: str
    leader: str
    members: str
    sync: str

    def member(self, instance_id: str) -> str:
        return self.members + instance_id


def group_keys(cluster_id: str) -> GroupKeys:
    p = f"{ROOT}/{cluster_id}/"
    return GroupKeys(p, p + "leader", p + "members/", p + "sync")


@dataclass(frozen=True)
class LeaderInfo:
    """What the leader publishes in its campaign key (``epoch`` comes from the
    key's create_revision, not from the value)."""

    instance_id: str
    address: str  # RPC, HOST:PORT
    replication: str = ""  # the journal stream standbys connect to (socket:// or ZeroMQ tcp://)
    metrics: str = ""  # HOST:PORT of GET /health, /metrics
    epoch: int = 0

    def encode(self) -> bytes:
        d = asdict(self)
        d.pop("epoch")
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes, epoch: int) -> LeaderInfo:
        d = json.loads(value)
        if not isinstance(d, dict) or not isinstance(d.get("address"), str):
            raise ValueError("leader value must be a JSON object with an address")
        return cls(str(d.get("instance_id", "")), d["address"], str(d.get("replication", "")),
                   str(d.get("metrics", "")), epoch)


@dataclass(frozen=True)
class MemberInfo:
    """What every instance publishes under ``members/``."""

    instance_id: str
    address: str
    metrics: str = ""
    replication: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes) -> MemberInfo:
        d = json.loads(value)
        if not isinstance(d, dict):
            raise ValueError("member value must be a JSON object")
        return cls(str(d.get("instance_id", "")), str(d.get("address", "")),
                   str(d.get("metrics", "")), str(d.get("replication", "")))


# ================================================================ wire types
def _b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _range_end(prefix: bytes) -> bytes:
    """The etcd range end that makes ``[prefix, end)`` every key with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KeyValue:
        return cls(_unb64(d.get("key")), _unb64(d.get("value")),
                   int(d.get("create_revision", 0)), int(d.get("mod_revision", 0)),
                   int(d.get("version", 0)), int(d.get("lease", 0)))


class CompareTarget(StrEnum):
    VERSION = "VERSION"
    CREATE = "CREATE"
    MOD = "MOD"
    VALUE = "VALUE"
    LEASE = "LEASE"


_TARGET_FIELD = {CompareTarget.VERSION: "version", CompareTarget.CREATE: "createRevision",
                 CompareTarget.MOD: "modRevision", CompareTarget.VALUE: "value",
                 CompareTarget.LEASE: "lease"}
_RESULTS = {"=": "EQUAL", ">": "GREATER", "<": "LESS", "!=": "NOT_EQUAL"}


@dataclass(frozen=True)
class Compare:
    """One txn guard, e.g. ``Compare(key, CompareTarget.CREATE, "=", 0)`` (absent)."""

    key: str
    target: CompareTarget
    op: str
    value: int | bytes

    def to_json(self) -> dict[str, Any]:
        v: Any = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target.value,
                "result": _RESULTS[self.op], _TARGET_FIELD[self.target]: v}


@dataclass(frozen=True)
class PutOp:
    key: str
    value: bytes
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        req: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            req["lease"] = str(self.lease)
        return {"requestPut": req}


@dataclass(frozen=True)
class RangeOp:
    key: str
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        req = {"key": _b64(self.key)}
        if self.prefix:
            req["range_end"] = _b64(_range_end(self.key.encode()))
        return {"requestRange": req}


@dataclass(frozen=True)
class DeleteOp:
    key: str

    def to_json(self) -> dict[str, Any]:
        return {"requestDeleteRange": {"key": _b64(self.key)}}


TxnOp = PutOp | RangeOp | DeleteOp


@dataclass
class TxnResult:
    succeeded: bool
    revision: int  # the store's revision after the txn (a put's revision if it wrote)
    ranges: list[list[KeyValue]] = field(default_factory=list)  # one list per RangeOp run


class EtcdError(KVPoolError):
    """etcd could not be reached in time (``COORDINATION_UNAVAILABLE``), or it
    refused a request (``INTERNAL_ERROR`` with etcd's message)."""


# ================================================================ client
class EtcdClient:
    """Blocking etcd v3 client over the JSON gateway; thread-safe (a lock
    serializes calls on one kept-alive connection; use one client per thread
    that must not wait for another, e.g. the lease keeper).

    Every call is bounded by ``timeout_s`` per endpoint tried; a connection
    error or timeout moves to the next endpoint, and after all of them the
    call raises :class:`EtcdError` with ``COORDINATION_UNAVAILABLE``.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [_check_endpoint(e) for e in endpoints]
        self.timeout_s = timeout_s
        self._i = 0
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ---------------------------------------------------------------- transport
    def _connect(self, endpoint: str, timeout: float) -> http.client.HTTPConnection:
        host, port = endpoint.rsplit(":", 1)
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def request(self, path: str, body: dict[str, Any],
                timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` and return the decoded JSON reply."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        data = json.dumps(body).encode()
        last: BaseException | None = None
        with self._lock:
            if self._closed:
                raise EtcdError("etcd client is closed", ErrorCode.CLOSED)
            for _ in range(len(self.endpoints)):
                endpoint = self.endpoints[self._i]
                try:
                    if self._conn is None:
                        self._conn = self._connect(endpoint, timeout)
                    elif self._conn.sock is not None:
                        self._conn.sock.settimeout(timeout)
                    self._conn.request("POST", "/v3/" + path, data,
                                       {"Content-Type": "application/json"})
                    resp = self._conn.getresponse()
                    raw = resp.read()
                except (OSError, http.client.HTTPException) as exc:
                    last = exc
                    self._drop()
                    self._i = (self._i + 1) % len(self.endpoints)
                    continue
                try:
                    reply = json.loads(raw) if raw else {}
                except ValueError as exc:
                    raise EtcdError(f"etcd {endpoint}: bad reply to {path}: {raw[:200]!r}",
                                    ErrorCode.INTERNAL_ERROR) from exc
                if resp.status != 200:
                    msg = str(reply.get("message") or reply.get("error")
                              or raw[:200].decode(errors="replace"))
                    code = ErrorCode.INTERNAL_ERROR
                    if resp.status in (503, 504) or "timed out" in str(msg) \
                            or "no leader" in str(msg):
                        # etcd answered but cannot commit: no quorum
                        code = ErrorCode.COORDINATION_UNAVAILABLE
                    raise EtcdError(f"etcd {endpoint}: {path}: {msg}", code)
                return reply if isinstance(reply, dict) else {}
        raise EtcdError(f"no etcd endpoint of {','.join(self.endpoints)} answered "
                        f"{path} within {timeout:.1f}s ({last})",
                        ErrorCode.COORDINATION_UNAVAILABLE)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- kv
    def range(self, key: str, prefix: bool = False) -> tuple[list[KeyValue], int]:
        """The key (or every key under ``prefix``) and the store revision."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_range_end(key.encode()))
        reply = self.request("kv/range", body)
        kvs = [KeyValue.from_json(kv) for kv in reply.get("kvs", ())]
        return kvs, int(reply.get("header", {}).get("revision", 0))

    def get(self, key: str) -> KeyValue | None:
        kvs, _rev = self.range(key)
        return kvs[0] if kvs else None

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; return the revision of the write."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        reply = self.request("kv/put", body)
        return int(reply.get("header", {}).get("revision", 0))

    def delete(self, key: str, prefix: bool = False) -> int:
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_range_end(key.encode()))
        return int(self.request("kv/deleterange", body).get("deleted", 0))

    def txn(self, compare: Sequence[Compare], success: Sequence[TxnOp],
            failure: Sequence[TxnOp] = ()) -> TxnResult:
        """An atomic If(compare...) Then(success...) Else(failure...)."""
        reply = self.request("kv/txn", {
            "compare": [c.to_json() for c in compare],
            "success": [o.to_json() for o in success],
            "failure": [o.to_json() for o in failure]})
        ranges = []
        for r in reply.get("responses", ()):
            rr = r.get("response_range")
            if rr is not None:
                ranges.append([KeyValue.from_json(kv) for kv in rr.get("kvs", ())])
        return TxnResult(bool(reply.get("succeeded", False)),
                         int(reply.get("header", {}).get("revision", 0)), ranges)

    # ---------------------------------------------------------------- leases
    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, granted TTL in s; etcd may raise a short TTL to its minimum)."""
        reply = self.request("lease/grant", {"TTL": str(int(ttl_s))})
        if reply.get("error"):
            raise EtcdError(f"lease grant: {reply['error']}", ErrorCode.INTERNAL_ERROR)
        return int(reply["ID"]), int(reply.get("TTL", ttl_s))

    def lease_keepalive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Renew once; return the TTL granted from now (0: the lease is gone)."""
        reply = self.request("lease/keepalive", {"ID": str(lease_id)}, timeout_s)
        result = reply.get("result", reply)
        return int(result.get("TTL", 0))

    def lease_revoke(self, lease_id: int) -> None:
        try:
            self.request("lease/revoke", {"ID": str(lease_id)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    def status(self) -> dict[str, Any]:
        """etcd's maintenance status of the endpoint answering (version, leader, ...)."""
        return self.request("maintenance/status", {})

    # ---------------------------------------------------------------- watch
    def watch(self, key: str, start_revision: int = 0, prefix: bool = False,
              idle_timeout_s: float = 30.0) -> Watch:
        """A stream of changes to ``key`` (or the prefix) from ``start_revision``
        (0: from now). Iterate it in one thread; ``close()`` from any thread."""
        return Watch(self.endpoints, key, start_revision, prefix, idle_timeout_s,
                     self.timeout_s)


class EventType(StrEnum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True)
class WatchEvent:
    type: EventType
    kv: KeyValue


class Watch:
    """One streaming ``/v3/watch``: iterate batches of :class:`WatchEvent`.

    The stream is reconnected transparently (from the revision after the last
    event seen) when its connection breaks or stays silent for
    ``idle_timeout_s``; if etcd compacted that revision away, iteration
    yields an empty batch with ``compacted`` set, and the caller re-reads.
    Iteration ends after ``close()``.
    """

    def __init__(self, endpoints: Sequence[str], key: str, start_revision: int, prefix: bool,
                 idle_timeout_s: float, connect_timeout_s: float) -> None:
        self.endpoints = list(endpoints)
        self.key = key
        self.prefix = prefix
        self.next_revision = start_revision
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.compacted = False
        self._i = 0
        self._conn: http.client.HTTPConnection | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()

    def _open(self) -> http.client.HTTPResponse:
        endpoint = self.endpoints[self._i % len(self.endpoints)]
        self._i += 1
        host, port = endpoint.rsplit(":", 1)
        conn = http.client.HTTPConnection(host.strip("[]"), int(port),
                                          timeout=self.connect_timeout_s)
        with self._lock:
            if self._closed.is_set():
                raise EOFError
            self._conn = conn
        req: dict[str, Any] = {"key": _b64(self.key)}
        if self.prefix:
            req["range_end"] = _b64(_range_end(self.key.encode()))
        if self.next_revision:
            req["start_revision"] = str(self.next_revision)
        conn.request("POST", "/v3/watch", json.dumps({"create_request": req}).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"watch: HTTP {resp.status}")
        if conn.sock is not None:
            conn.sock.settimeout(self.idle_timeout_s)
        return resp

    def __iter__(self) -> Iterator[list[WatchEvent]]:
        while not self._closed.is_set():
            try:
                resp = self._open()
            except EOFError:
                return
            except (OSError, http.client.HTTPException) as exc:
                log.debug("watch %s: %s", self.key, exc)
                self._closed.wait(0.1)
                continue
            try:
                while not self._closed.is_set():
                    line = resp.readline()
                    if not line:
                        break
                    msg = json.loads(line).get("result", {})
                    if int(msg.get("compact_revision", 0) or 0):
                        self.compacted = True
                        self.next_revision = 0
                        yield []
                        break
                    events = []
                    for ev in msg.get("events", ()):
                        kv = KeyValue.from_json(ev.get("kv", {}))
                        events.append(WatchEvent(EventType(ev.get("type", "PUT")), kv))
                        self.next_revision = max(self.next_revision, kv.mod_revision + 1)
                    if events:
                        yield events
            except Exception as exc:  # also http.client internals racing close()
                log.debug("watch %s: stream ended (%s); reconnecting", self.key, exc)
            finally:
                self._close_conn()

    def _close_conn(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            if conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        self._closed.set()
        self._close_conn()


# ================================================================ resolver
class LeaderResolver:
    """Find a master group's leader through etcd and follow it.

    A background thread watches the campaign key; ``current()`` is the cached
    leader (None while no instance leads), ``wait(timeout_s)`` blocks until one
    is known, ``refresh()`` re-reads etcd now (use it when the cached leader
    stopped answering: a watch can lag behind a failure). ``on_change``
    callbacks run in the watch thread with the new leader (or None).
    """

    def __init__(self, target: EtcdTarget | str, timeout_s: float = 1.0,
                 watch: bool = True) -> None:
        self.target = parse_etcd_url(target) if isinstance(target, str) else target
        self.keys = group_keys(self.target.cluster_id)
        self._etcd = EtcdClient(self.target.endpoints, timeout_s)
        self._cond = threading.Condition()
        self._leader: LeaderInfo | None = None
        self._revision = 0
        self._callbacks: list[Callable[[LeaderInfo | None], None]] = []
        self._watch: Watch | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        try:
            self.refresh()
        except EtcdError as exc:  # etcd down now: the watch keeps trying
            log.warning("leader resolver: %s", exc)
        if watch:
            self._thread = threading.Thread(target=self._run, name="kvpool-etcd-resolver",
                                            daemon=True)
            self._thread.start()

    def current(self) -> LeaderInfo | None:
        return self._leader

    def on_change(self, callback: Callable[[LeaderInfo | None], None]) -> None:
        self._callbacks.append(callback)

    def _set(self, leader: LeaderInfo | None, revision: int) -> None:
        with self._cond:
            if revision < self._revision:
                return  # an older view than the one we hold
            self._revision = revision
            changed = leader != self._leader
            self._leader = leader
            self._cond.notify_all()
        if changed:
            log.info("leader of %s: %s", self.target.cluster_id,
                     f"{leader.address} (epoch {leader.epoch})" if leader else "none")
            for cb in self._callbacks:
                try:
                    cb(leader)
                except Exception:
                    log.exception("leader change callback failed")

    @staticmethod
    def _decode(kv: KeyValue | None) -> LeaderInfo | None:
        if kv is None:
            return None
        try:
            return LeaderInfo.decode(kv.value, kv.create_revision)
        except ValueError as exc:
            log.warning("ignoring malformed leader value %r: %s", kv.value[:100], exc)
            return None

    def refresh(self) -> LeaderInfo | None:
        """Read the campaign key now (raises EtcdError when etcd is unreachable)."""
        kvs, rev = self._etcd.range(self.keys.leader)
        leader = self._decode(kvs[0] if kvs else None)
        self._set(leader, rev)
        return leader

    def wait(self, timeout_s: float, newer_than: int = 0) -> LeaderInfo:
        """The leader, waiting up to ``timeout_s`` for one whose epoch is above
        ``newer_than``; raises KVPoolError(NO_LEADER) when none appears."""
        deadline = time.monotonic() + timeout_s
        next_read = time.monotonic() + 0.5
        with self._cond:
            while True:
                leader = self._leader
                if leader is not None and leader.epoch > newer_than:
                    return leader
                now = time.monotonic()
                if now >= deadline:
                    raise KVPoolError(f"no leader of master group {self.target.url()} "
                                      f"within {timeout_s:.1f}s", ErrorCode.NO_LEADER)
                if self._thread is None or now >= next_read:
                    # no watch, or a watch that may lag: read etcd directly
                    next_read = now + 0.5
                    self._cond.release()
                    try:
                        with contextlib.suppress(EtcdError):
                            self.refresh()
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(min(deadline, next_read) - now)

    def members(self) -> list[tuple[MemberInfo, bool]]:
        """Every registered instance and whether it is the leader now."""
        kvs, _rev = self._etcd.range(self.keys.members, prefix=True)
        leader = self.refresh()
        out = []
        for kv in kvs:
            try:
                m = MemberInfo.decode(kv.value)
            except ValueError:
                continue
            out.append((m, leader is not None and m.instance_id == leader.instance_id))
        return out

    def _run(self) -> None:
        while not self._closed:
            watch = Watch(self.target.endpoints, self.keys.leader, self._revision + 1, False,
                          30.0, self._etcd.timeout_s)
            self._watch = watch
            if self._closed:
                break
            for events in watch:
                if not events:  # compacted: read the key afresh, then watch from there
                    with contextlib.suppress(EtcdError):
                        self.refresh()
                    break
                for ev in events:
                    leader = None if ev.type == EventType.DELETE else self._decode(ev.kv)
                    self._set(leader, ev.kv.mod_revision)
            if not self._closed:
                time.sleep(0.05)

    def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.close()
        if self._thread is not None:
            self._thread.join(2)
        self._etcd.close()

    def __enter__(self) -> LeaderResolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: dict[str, LeaderResolver] = {}
_SHARED_LOCK = threading.Lock()


def shared_resolver(address: str | EtcdTarget) -> LeaderResolver:
    """The process's one watching resolver of a master group (created on first
    use, kept for the process's life: every client of the group shares it)."""
    target = parse_etcd_url(address) if isinstance(address, str) else address
    key = target.url()
    with _SHARED_LOCK:
        r = _SHARED.get(key)
        if r is None or r._closed:
            r = _SHARED[key] = LeaderResolver(target)
        return r

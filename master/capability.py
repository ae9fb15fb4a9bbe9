"""Short-lived, HMAC-signed capabilities for data-plane access.

The master grants, per replica, a capability: "op READ (or WRITE) on
``[offset, offset + length)`` of segment S until ``expiry_ms``". It signs the
capability with S's key (a random 32-byte key the master creates per segment
and hands to the segment's owner at mount). The owner's transfer server
verifies the token on every request and refuses anything outside it, so a
peer that can reach a transfer server can touch only the bytes the master
granted it, for as long as the grant lasts.

Offsets are relative to the segment's usable region (the same convention as
``ReplicaDescriptor.offset`` and ``TransferRequest.offset``).

Token layout (version 1, big-endian)::

    B  version (1)         B  op (CapOp)          H  segment id length n
    Q  offset              Q  length              Q  expiry (epoch ms)
    8s nonce               ns segment id (utf-8)  16s tag

``tag`` = HMAC-SHA256(key, DOMAIN || everything before the tag), truncated
to 128 bits (RFC 4868 style). Verifying costs one struct unpack and one HMAC
over < 100 bytes: a few microseconds.

Replay: a token is a bearer credential for its range until it expires; it
cannot be reused for another segment (other key), another range or another
op. Keep ``ttl_ms`` short (the master uses about the read-lease length).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from kvpool.master.errors import ErrorCode, KVPoolError

__all__ = [
    "KEY_LENGTH",
    "TAG_LENGTH",
    "TOKEN_VERSION",
    "CapOp",
    "Capability",
    "CapabilityError",
    "CapabilitySigner",
    "CapabilityVerifier",
    "DenyReason",
    "decode",
    "new_segment_key",
    "refusal_metrics",
    "sign",
    "verify",
    "wall_clock_ms",
]

TOKEN_VERSION = 1
KEY_LENGTH = 32
TAG_LENGTH = 16
NONCE_LENGTH = 8
MAX_SEGMENT_ID_LENGTH = 1024
_DOMAIN = b"kvpool-capability\x00"
_HEADER = struct.Struct(">BBHQQQ8s")
_MIN_LENGTH = _HEADER.size + TAG_LENGTH


class CapOp(IntEnum):
    """What a capability allows. A READ capability never allows a WRITE and vice versa."""

    READ = 1
    WRITE = 2

    @classmethod
    def coerce(cls, op: Any) -> CapOp:
        """Accept a CapOp, its int value, its name, or any enum named READ/WRITE
        (e.g. ``kvpool.transfer.TransferOp``)."""
        if isinstance(op, CapOp):
            return op
        name = getattr(op, "name", op)
        if isinstance(name, str) and name.upper() in cls.__members__:
            return cls[name.upper()]
        if isinstance(op, int) and not isinstance(op, bool):
            try:
                return cls(op)
            except ValueError:
                pass
        raise KVPoolError(f"not a capability op: {op!r}", ErrorCode.INVALID_PARAMS)


class DenyReason(StrEnum):
    """Why a capability was refused (the label of the refusal metric)."""

    MISSING = "missing"  # no token where one is required
    MALFORMED = "malformed"  # truncated, garbage or unknown version
    NO_KEY = "no_key"  # the verifier holds no key for the segment
    WRONG_SEGMENT = "wrong_segment"  # an authentic-looking token for another segment
    FORGED = "forged"  # the tag does not match (tampered or wrong key)
    WRONG_OP = "wrong_op"  # READ token used to WRITE or vice versa
    EXPIRED = "expired"
    OUT_OF_RANGE = "out_of_range"  # request wider than / outside the granted range


class CapabilityError(KVPoolError):
    """A request was refused: ``code`` is PERMISSION_DENIED, ``reason`` says why."""

    code = ErrorCode.PERMISSION_DENIED

    def __init__(self, reason: DenyReason, message: str) -> None:
        self.reason = reason
        super().__init__(f"capability refused ({reason.value}): {message}",
                         ErrorCode.PERMISSION_DENIED)


def wall_clock_ms() -> int:
    """Wall-clock epoch milliseconds (capability expiry is wall-clock: it crosses hosts)."""
    return time.time_ns() // 1_000_000


def new_segment_key() -> bytes:
    """A fresh random per-segment signing key (32 bytes from the OS CSPRNG)."""
    return os.urandom(KEY_LENGTH)


@dataclass(frozen=True, slots=True)
class Capability:
    """A grant: ``op`` on ``[offset, offset + length)`` of ``segment_id`` until ``expiry_ms``."""

    segment_id: str
    offset: int
    length: int
    op: CapOp
    expiry_ms: int
    nonce: bytes = field(default=b"")

    def covers(self, offset: int, length: int) -> bool:
        """True if ``[offset, offset + length)`` lies inside the granted range."""
        return (
            offset >= self.offset
            and length >= 0
            and offset + length <= self.offset + self.length
        )


def _tag(key: bytes, body: bytes) -> bytes:
    return hmac.digest(key, _DOMAIN + body, hashlib.sha256)[:TAG_LENGTH]


def sign(cap: Capability, key: bytes) -> bytes:
    """Encode ``cap`` and append its HMAC tag under ``key``; returns the token.

    Raises INVALID_PARAMS for negative/oversized fields or an empty key. A
    missing nonce is filled with 8 random bytes so two grants of the same
    range are distinct tokens.
    """
    if not key:
        raise KVPoolError("capability key must not be empty", ErrorCode.INVALID_PARAMS)
    seg = cap.segment_id.encode()
    if not seg or len(seg) > MAX_SEGMENT_ID_LENGTH:
        raise KVPoolError("capability segment id empty or too long", ErrorCode.INVALID_PARAMS)
    for name in ("offset", "length", "expiry_ms"):
        v = getattr(cap, name)
        if not 0 <= v < 1 << 64:
            raise KVPoolError(f"capability {name} out of range: {v}", ErrorCode.INVALID_PARAMS)
    nonce = cap.nonce or os.urandom(NONCE_LENGTH)
    if len(nonce) != NONCE_LENGTH:
        raise KVPoolError(f"nonce must be {NONCE_LENGTH} bytes", ErrorCode.INVALID_PARAMS)
    body = _HEADER.pack(TOKEN_VERSION, int(CapOp.coerce(cap.op)), len(seg), cap.offset,
                        cap.length, cap.expiry_ms, nonce) + seg
    return body + _tag(key, body)


def decode(token: bytes | bytearray | memoryview) -> Capability:
    """Parse a token WITHOUT checking its tag (for logging/inspection only).

    Raises :class:`CapabilityError` (MALFORMED) on anything that is not a
    well-formed version-1 token.
    """
    cap, _, _ = _parse(token)
    return cap


def _parse(token: Any) -> tuple[Capability, bytes, bytes]:
    if not isinstance(token, bytes | bytearray | memoryview):
        raise CapabilityError(DenyReason.MALFORMED, f"token is a {type(token).__name__}")
    raw = bytes(token)
    if not raw:
        raise CapabilityError(DenyReason.MISSING, "no capability presented")
    if len(raw) < _MIN_LENGTH:
        raise CapabilityError(DenyReason.MALFORMED, f"token of {len(raw)} bytes is truncated")
    version, op, seg_len, offset, length, expiry, nonce = _HEADER.unpack_from(raw)
    if version != TOKEN_VERSION:
        raise CapabilityError(DenyReason.MALFORMED, f"unknown token version {version}")
    if len(raw) != _HEADER.size + seg_len + TAG_LENGTH:
        raise CapabilityError(DenyReason.MALFORMED, "token length does not match its header")
    try:
        cap_op = CapOp(op)
        seg = raw[_HEADER.size:_HEADER.size + seg_len].decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise CapabilityError(DenyReason.MALFORMED, f"bad token field: {exc}") from None
    body_end = _HEADER.size + seg_len
    return Capability(seg, offset, length, cap_op, expiry, nonce), raw[:body_end], raw[body_end:]


def verify(
    token: bytes | bytearray | memoryview,
    key: bytes,
    segment_id: str,
    offset: int,
    length: int,
    op: CapOp | Any,
    now_ms: int | None = None,
    leeway_ms: int = 0,
) -> Capability:
    """Check that ``token`` allows ``op`` on ``[offset, offset+length)`` of ``segment_id``.

    Returns the verified :class:`Capability`; raises :class:`CapabilityError`
    (a KVPoolError with code PERMISSION_DENIED) whose ``reason`` tells a
    forged, expired, widened, other-segment, wrong-op or malformed token
    apart. Semantic reasons (op, expiry, range) are reported only for tokens
    whose tag verified. ``leeway_ms`` tolerates clock skew between hosts.
    """
    cap, body, tag = _parse(token)
    if cap.segment_id != segment_id:
        raise CapabilityError(
            DenyReason.WRONG_SEGMENT,
            f"token is for segment {cap.segment_id!r}, request is for {segment_id!r}",
        )
    if not hmac.compare_digest(tag, _tag(key, body)):
        raise CapabilityError(DenyReason.FORGED, f"bad signature for segment {segment_id!r}")
    want = CapOp.coerce(op)
    if cap.op != want:
        raise CapabilityError(DenyReason.WRONG_OP, f"token allows {cap.op.name}, not {want.name}")
    now = wall_clock_ms() if now_ms is None else now_ms
    if now > cap.expiry_ms + leeway_ms:
        raise CapabilityError(DenyReason.EXPIRED, f"expired {now - cap.expiry_ms} ms ago")
    if not cap.covers(offset, length):
        raise CapabilityError(
            DenyReason.OUT_OF_RANGE,
            f"request [{offset}, {offset + length}) outside granted "
            f"[{cap.offset}, {cap.offset + cap.length})",
        )
    return cap


class CapabilitySigner:
    """The master's side: one key per segment; grants tokens for replicas.

    Thread-safe. ``keys()``/``load_keys()`` let the master persist keys in its
    snapshot so tokens stay valid and owners need no new key after a restart.
    """

    def __init__(self, ttl_ms: int = 10_000) -> None:
        if ttl_ms <= 0:
            raise KVPoolError("capability ttl_ms must be > 0", ErrorCode.INVALID_PARAMS)
        self.ttl_ms = ttl_ms
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def key_for(self, segment_id: str) -> bytes:
        """The segment's key, created on first use (hand it to the owner at mount)."""
        with self._lock:
            key = self._keys.get(segment_id)
            if key is None:
                key = self._keys[segment_id] = new_segment_key()
            return key

    def forget(self, segment_id: str) -> None:
        """Drop a segment's key (segment unmounted or its owner declared dead)."""
        with self._lock:
            self._keys.pop(segment_id, None)

    def grant(self, segment_id: str, offset: int, length: int, op: CapOp | Any,
              ttl_ms: int | None = None) -> bytes:
        """A signed token for ``op`` on ``[offset, offset+length)``, valid ``ttl_ms``."""
        cap = Capability(segment_id, offset, length, CapOp.coerce(op),
                         wall_clock_ms() + (self.ttl_ms if ttl_ms is None else ttl_ms))
        return sign(cap, self.key_for(segment_id))

    def keys(self) -> dict[str, bytes]:
        """A copy of every segment key (for the master's snapshot)."""
        with self._lock:
            return dict(self._keys)

    def load_keys(self, keys: dict[str, bytes]) -> None:
        """Restore keys from a snapshot (existing keys are replaced)."""
        with self._lock:
            self._keys.update({str(k): bytes(v) for k, v in keys.items()})


class CapabilityVerifier:
    """The transfer server's side: keys of the local segments + refusal counters.

    ``check`` raises :class:`CapabilityError` and counts the refusal by
    reason (``refusals``); ``on_refusal(reason)`` is also called, e.g. to bump
    a Prometheus counter. With ``required=False`` a request without a token
    passes (migration/loopback mode); a token that is present is always checked.
    """

    def __init__(
        self,
        required: bool = True,
        leeway_ms: int = 2000,
        on_refusal: Callable[[DenyReason], None] | None = None,
    ) -> None:
        self.required = required
        self.leeway_ms = leeway_ms
        self.on_refusal = on_refusal
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.refusals: dict[DenyReason, int] = dict.fromkeys(DenyReason, 0)
        self.accepted = 0

    def set_key(self, segment_id: str, key: bytes) -> None:
        """Install (or replace) the key the master handed over for a local segment."""
        if not key:
            raise KVPoolError("capability key must not be empty", ErrorCode.INVALID_PARAMS)
        with self._lock:
            self._keys[segment_id] = bytes(key)

    def remove_key(self, segment_id: str) -> None:
        with self._lock:
            self._keys.pop(segment_id, None)

    def _refuse(self, exc: CapabilityError) -> CapabilityError:
        with self._lock:
            self.refusals[exc.reason] += 1
        if self.on_refusal is not None:
            self.on_refusal(exc.reason)
        return exc

    def check(self, token: bytes | bytearray | memoryview | None, segment_id: str,
              offset: int, length: int, op: CapOp | Any) -> None:
        """Allow or refuse one request (see :func:`verify` for the rules)."""
        if not token:
            if not self.required:
                return
            raise self._refuse(CapabilityError(DenyReason.MISSING, "no capability presented"))
        key = self._keys.get(segment_id)
        if key is None:
            raise self._refuse(CapabilityError(
                DenyReason.NO_KEY, f"no key for segment {segment_id!r} on this server"))
        try:
            verify(token, key, segment_id, offset, length, op, leeway_ms=self.leeway_ms)
        except CapabilityError as exc:
            raise self._refuse(exc) from None
        self.accepted += 1  # approximate under threads; informational only

    @property
    def refused_total(self) -> int:
        return sum(self.refusals.values())


def refusal_metrics(verifier: CapabilityVerifier) -> Any:
    """Prometheus metric families for a verifier, read at scrape time (for a Collector):
    ``kvpool_capability_refusals_total{reason}`` and ``kvpool_capability_accepted_total``."""
    from prometheus_client.core import CounterMetricFamily

    refused = CounterMetricFamily("kvpool_capability_refusals",
                                  "transfer requests refused by the capability check",
                                  labels=["reason"])
    for reason, n in dict(verifier.refusals).items():
        refused.add_metric([reason.value], n)
    accepted = CounterMetricFamily("kvpool_capability_accepted",
                                   "transfer requests whose capability verified")
    accepted.add_metric([], verifier.accepted)
    return [refused, accepted]

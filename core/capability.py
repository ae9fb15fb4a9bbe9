"""Short-lived, MAC-signed capabilities for data-plane access, one per batch.

The master grants, per reply and segment, a capability: "op READ (or WRITE)
on exactly these ranges ``[offset, offset + length)`` of segment S until
``expiry_ms``". It signs the capability with S's key (a random 32-byte key
the master creates per segment and hands to the segment's owner at mount).
The owner's transfer server verifies the token before any byte moves and
refuses anything outside its ranges, so a peer that can reach a transfer
server can touch only the bytes the master granted it, for as long as the
grant lasts.

One token covers every range a reply grants on one segment (up to
``MAX_RANGES``; a larger batch gets several tokens), so the master signs once
per batch and segment instead of once per key (packing the ranges is one
``struct.pack``; the MAC runs in C over them), and a verifier that has seen a
token checks the next request presenting the same token with two dictionary
lookups (the token, then the request's offset among the granted ones; a
binary search for a range inside a granted one), no MAC
(:class:`CapabilityVerifier` keeps the last ``cache_size`` verified tokens of
each segment, until the key changes; each use still checks the epoch, op,
expiry and range).
What a token authorizes is unchanged by batching: the exact ranges, the op,
the expiry, under the segment's key.

Offsets are relative to the segment's usable region (the same convention as
``ReplicaDescriptor.offset`` and ``TransferRequest.offset``).

Token layout (version 4, big-endian)::

    B  version (4)         B  op (CapOp)          H  segment id length n
    I  range count k       Q  expiry (epoch ms)   Q  nonce
    Q  leader epoch        ns segment id (utf-8)  k x (Q offset, Q length)
    16s tag

``tag`` = keyed BLAKE2b-128(key, person="kvpool-cap-v4", everything before
the tag). BLAKE2's keyed mode is a MAC by design (no HMAC construction
needed); with the keyed state precomputed per segment and copied per token
a one-range token costs ~0.6 us in CPython, each further range ~20 ns.

Epoch (fencing, docs/ha.md): the term of the master that signed the token
(the etcd revision that elected it; 0 for a master without HA, whose
tokens behave exactly as before). A :class:`CapabilityVerifier` keeps the
highest epoch it has seen, from authentic tokens and from the master's
ping replies (:meth:`CapabilityVerifier.observe_epoch`), and refuses a
token of a lower epoch with ``STALE_EPOCH`` (code ``ErrorCode.STALE_EPOCH``:
the caller asks the master again, which after a failover is the new
leader). So once a node daemon has heard of a new term, grants of a
deposed leader, including one still serving reads while cut off from
etcd, stop working there. Epochs only grow within one etcd cluster;
replacing the etcd cluster (revisions restart) needs the node daemons
restarted, else they refuse the new, lower epochs.

Replay: a token is a bearer credential for its ranges until it expires; it
cannot be reused for another segment (other key), other ranges or another
op. Keep ``ttl_ms`` short (the master uses about the read-lease length).
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import itertools
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "KEY_LENGTH",
    "MAX_RANGES",
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

TOKEN_VERSION = 4
KEY_LENGTH = 32
TAG_LENGTH = 16
NONCE_LENGTH = 8
MAX_SEGMENT_ID_LENGTH = 1024
#: ranges per token: bounds a token (and so a transfer request header) to ~1 KiB
MAX_RANGES = 64
_PERSON = b"kvpool-cap-v4"  # BLAKE2 personalization: domain separation
_HEADER = struct.Struct(">BBHIQQQ")  # ... expiry, nonce, epoch
_PACK = _HEADER.pack
_RANGE = struct.Struct(">QQ")
_U64 = (1 << 64) - 1
_MIN_LENGTH = _HEADER.size + _RANGE.size + TAG_LENGTH
# packers of k ranges, made on first use
_RANGES_PACK: dict[int, Callable[..., bytes]] = {}


def _ranges_pack(k: int) -> Callable[..., bytes]:
    p = _RANGES_PACK.get(k)
    if p is None:
        p = _RANGES_PACK[k] = struct.Struct(f">{2 * k}Q").pack
    return p


# unpackers of k ranges (``(buffer, offset) -> flat tuple``), made on first use
_RANGES_UNPACK: dict[int, Callable[[bytes, int], tuple[int, ...]]] = {}


def _ranges_unpack(k: int) -> Callable[[bytes, int], tuple[int, ...]]:
    u = _RANGES_UNPACK.get(k)
    if u is None:
        u = _RANGES_UNPACK[k] = struct.Struct(f">{2 * k}Q").unpack_from
    return u


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


_OPS = {int(op): op for op in CapOp}


class DenyReason(StrEnum):
    """Why a capability was refused (the label of the refusal metric)."""

    MISSING = "missing"  # no token where one is required
    MALFORMED = "malformed"  # truncated, garbage or unknown version
    NO_KEY = "no_key"  # the verifier holds no key for the segment
    WRONG_SEGMENT = "wrong_segment"  # an authentic-looking token for another segment
    FORGED = "forged"  # the tag does not match (tampered or wrong key)
    WRONG_OP = "wrong_op"  # READ token used to WRITE or vice versa
    EXPIRED = "expired"
    OUT_OF_RANGE = "out_of_range"  # request wider than / outside every granted range
    STALE_EPOCH = "stale_epoch"  # signed by a master of an older leader term (HA fencing)


class CapabilityError(KVPoolError):
    """A request was refused: ``reason`` says why. ``code`` is PERMISSION_DENIED,
    except STALE_EPOCH for :attr:`DenyReason.STALE_EPOCH` (retryable: a fresh
    grant from the current leader passes)."""

    code = ErrorCode.PERMISSION_DENIED

    def __init__(self, reason: DenyReason, message: str) -> None:
        self.reason = reason
        super().__init__(f"capability refused ({reason.value}): {message}",
                         ErrorCode.STALE_EPOCH if reason is DenyReason.STALE_EPOCH
                         else ErrorCode.PERMISSION_DENIED)


_time_ns = time.time_ns


def wall_clock_ms() -> int:
    """Wall-clock epoch milliseconds (capability expiry is wall-clock: it crosses hosts)."""
    return time.time_ns() // 1_000_000


def new_segment_key() -> bytes:
    """A fresh random per-segment signing key (32 bytes from the OS CSPRNG)."""
    return os.urandom(KEY_LENGTH)


@dataclass(frozen=True, slots=True)
class Capability:
    """A grant: ``op`` on each ``(offset, length)`` of ``ranges`` of ``segment_id``
    until ``expiry_ms``."""

    segment_id: str
    ranges: tuple[tuple[int, int], ...]
    op: CapOp
    expiry_ms: int
    nonce: int = field(default=-1)  # -1: sign() picks a random one
    epoch: int = 0  # leader term of the signing master (0: no HA)

    @classmethod
    def single(cls, segment_id: str, offset: int, length: int, op: CapOp, expiry_ms: int,
               nonce: int = -1, epoch: int = 0) -> Capability:
        """A grant of one range."""
        return cls(segment_id, ((offset, length),), op, expiry_ms, nonce, epoch)

    def covers(self, offset: int, length: int) -> bool:
        """True if ``[offset, offset + length)`` lies inside one granted range."""
        return length >= 0 and any(offset >= o and offset + length <= o + n
                                   for o, n in self.ranges)


def _mac_state(key: bytes) -> Any:
    """The keyed BLAKE2b state for ``key`` (copy it per token: skips the key block)."""
    return hashlib.blake2b(key=key, digest_size=TAG_LENGTH, person=_PERSON)


def sign(cap: Capability, key: bytes) -> bytes:
    """Encode ``cap`` and append its tag under ``key``; returns the token.

    Raises INVALID_PARAMS for negative/oversized fields, no ranges or more
    than ``MAX_RANGES``, or an empty key. A negative nonce is replaced by a
    random one so two grants of the same ranges are distinct tokens.
    """
    if not key:
        raise KVPoolError("capability key must not be empty", ErrorCode.INVALID_PARAMS)
    seg = cap.segment_id.encode()
    if not seg or len(seg) > MAX_SEGMENT_ID_LENGTH:
        raise KVPoolError("capability segment id empty or too long", ErrorCode.INVALID_PARAMS)
    if not 0 < len(cap.ranges) <= MAX_RANGES:
        raise KVPoolError(f"a capability holds 1..{MAX_RANGES} ranges", ErrorCode.INVALID_PARAMS)
    flat = [v for r in cap.ranges for v in r]
    for v in (*flat, cap.expiry_ms, cap.epoch):
        if type(v) is not int or not 0 <= v <= _U64:
            raise KVPoolError(f"capability field out of range: {v!r}", ErrorCode.INVALID_PARAMS)
    nonce = cap.nonce if cap.nonce >= 0 else int.from_bytes(os.urandom(NONCE_LENGTH), "big")
    if nonce > _U64:
        raise KVPoolError("nonce must fit 64 bits", ErrorCode.INVALID_PARAMS)
    body = _PACK(TOKEN_VERSION, int(CapOp.coerce(cap.op)), len(seg), len(cap.ranges),
                 cap.expiry_ms, nonce, cap.epoch) + seg + _ranges_pack(len(cap.ranges))(*flat)
    h = _mac_state(key)
    h.update(body)
    return body + h.digest()


def decode(token: bytes | bytearray | memoryview) -> Capability:
    """Parse a token WITHOUT checking its tag (for logging/inspection only).

    Raises :class:`CapabilityError` (MALFORMED) on anything that is not a
    well-formed version-4 token.
    """
    cap, _, _ = _parse(token)
    return cap


def _parse(token: Any) -> tuple[Capability, bytes, bytes]:
    if not isinstance(token, bytes | bytearray | memoryview):
        raise CapabilityError(DenyReason.MALFORMED, f"token is a {type(token).__name__}")
    raw = bytes(token)
    seg, op, expiry, nonce, epoch, flat, body_end = _fields(raw)
    ranges = tuple(zip(flat[::2], flat[1::2], strict=True))
    return (Capability(seg, ranges, op, expiry, nonce, epoch), raw[:body_end],
            raw[body_end:])


def _fields(raw: bytes) -> tuple[str, CapOp, int, int, int, tuple[int, ...], int]:
    """(segment id, op, expiry, nonce, epoch, flat ranges, body length) of a
    well-formed token; CapabilityError (MISSING / MALFORMED) otherwise."""
    if not raw:
        raise CapabilityError(DenyReason.MISSING, "no capability presented")
    if len(raw) < _MIN_LENGTH:
        raise CapabilityError(DenyReason.MALFORMED, f"token of {len(raw)} bytes is truncated")
    version, op, seg_len, count, expiry, nonce, epoch = _HEADER.unpack_from(raw)
    if version != TOKEN_VERSION:
        raise CapabilityError(DenyReason.MALFORMED, f"unknown token version {version}")
    if not 0 < count <= MAX_RANGES:
        raise CapabilityError(DenyReason.MALFORMED, f"token with {count} ranges")
    body_end = _HEADER.size + seg_len + count * _RANGE.size
    if len(raw) != body_end + TAG_LENGTH:
        raise CapabilityError(DenyReason.MALFORMED, "token length does not match its header")
    try:
        cap_op = _OPS[op]
        seg = raw[_HEADER.size:_HEADER.size + seg_len].decode()
    except (KeyError, UnicodeDecodeError) as exc:
        raise CapabilityError(DenyReason.MALFORMED, f"bad token field: {exc!r}") from None
    flat = _ranges_unpack(count)(raw, _HEADER.size + seg_len)
    return seg, cap_op, expiry, nonce, epoch, flat, body_end


def verify(
    token: bytes | bytearray | memoryview,
    key: bytes,
    segment_id: str,
    offset: int,
    length: int,
    op: CapOp | Any,
    now_ms: int | None = None,
    leeway_ms: int = 0,
    min_epoch: int = 0,
) -> Capability:
    """Check that ``token`` allows ``op`` on ``[offset, offset+length)`` of ``segment_id``.

    Returns the verified :class:`Capability`; raises :class:`CapabilityError`
    (a KVPoolError with code PERMISSION_DENIED, STALE_EPOCH for a token of
    an epoch below ``min_epoch``) whose ``reason`` tells a forged, expired,
    widened, other-segment, wrong-op, stale or malformed token apart.
    Semantic reasons (epoch, op, expiry, range) are reported only for tokens
    whose tag verified. ``leeway_ms`` tolerates clock skew between hosts.
    """
    grant = _authentic(token, _mac_state(key), segment_id)
    grant.check_epoch(min_epoch)
    grant.check(offset, length, CapOp.coerce(op), now_ms, leeway_ms)
    return grant.cap


class _Grant:
    """A verified token, ready for cheap range checks.

    ``exact`` maps each granted offset to a length granted there: a request
    for a granted range (the common case) is one dictionary lookup; anything
    else falls back to a binary search over the sorted ranges (built on
    first need)."""

    __slots__ = ("_reach", "_starts", "epoch", "exact", "expiry_ms", "flat", "nonce", "op",
                 "segment_id")

    def __init__(self, segment_id: str, op: CapOp, expiry_ms: int, nonce: int, epoch: int,
                 flat: tuple[int, ...]) -> None:
        self.segment_id = segment_id
        self.op = op
        self.expiry_ms = expiry_ms
        self.nonce = nonce
        self.epoch = epoch
        self.flat = flat
        # a repeated offset keeps one of its lengths: a shorter one only sends
        # the check to the binary search, which sees every range
        self.exact = {flat[0]: flat[1]} if len(flat) == 2 else \
            dict(zip(flat[::2], flat[1::2], strict=True))  # (one range: a single put/get)
        self._starts: list[int] | None = None
        self._reach: list[int] = []

    @property
    def cap(self) -> Capability:
        f = self.flat
        return Capability(self.segment_id, tuple(zip(f[::2], f[1::2], strict=True)), self.op,
                          self.expiry_ms, self.nonce, self.epoch)

    def check_epoch(self, min_epoch: int) -> None:
        if self.epoch < min_epoch:
            raise CapabilityError(
                DenyReason.STALE_EPOCH,
                f"signed in epoch {self.epoch}; epoch {min_epoch} has been seen: ask the "
                "master again")

    def check(self, offset: int, length: int, op: CapOp, now_ms: int | None,
              leeway_ms: int) -> None:
        if self.op is not op:
            raise CapabilityError(DenyReason.WRONG_OP,
                                  f"token allows {self.op.name}, not {op.name}")
        now = _time_ns() // 1_000_000 if now_ms is None else now_ms
        if now > self.expiry_ms + leeway_ms:
            raise CapabilityError(DenyReason.EXPIRED, f"expired {now - self.expiry_ms} ms ago")
        n = self.exact.get(offset)
        if n is None or not 0 <= length <= n:
            self.check_range(offset, length)

    def check_range(self, offset: int, length: int) -> None:
        """OUT_OF_RANGE unless ``[offset, offset + length)`` lies inside one granted range."""
        if length < 0 or not self._covers(offset, offset + length):
            raise CapabilityError(
                DenyReason.OUT_OF_RANGE,
                f"request [{offset}, {offset + length}) outside the granted ranges")

    def _covers(self, lo: int, hi: int) -> bool:
        # every range starting at or before lo is a candidate; one covers
        # [lo, hi) iff the furthest end among them reaches hi
        if self._starts is None:  # _reach first: a reader that sees _starts sees it
            f = self.flat
            spans = sorted(zip(f[::2], f[1::2], strict=True))
            self._reach = list(itertools.accumulate((o + n for o, n in spans), max))
            self._starts = [o for o, _ in spans]
        i = bisect.bisect_right(self._starts, lo)
        return i > 0 and self._reach[i - 1] >= hi


def _authentic(token: Any, state: Any, segment_id: str) -> _Grant:
    """The grant of ``token`` if it is well formed, for ``segment_id`` and its
    tag verifies under ``state`` (the segment's keyed MAC state)."""
    if not isinstance(token, bytes | bytearray | memoryview):
        raise CapabilityError(DenyReason.MALFORMED, f"token is a {type(token).__name__}")
    raw = token if type(token) is bytes else bytes(token)
    seg, op, expiry, nonce, epoch, flat, body_end = _fields(raw)
    if seg != segment_id:
        raise CapabilityError(
            DenyReason.WRONG_SEGMENT,
            f"token is for segment {seg!r}, request is for {segment_id!r}",
        )
    h = state.copy()
    h.update(memoryview(raw)[:body_end])
    if not hmac.compare_digest(raw[body_end:], h.digest()):
        raise CapabilityError(DenyReason.FORGED, f"bad signature for segment {segment_id!r}")
    return _Grant(seg, op, expiry, nonce, epoch, flat)


class CapabilitySigner:
    """The master's side: one key per segment; grants tokens for replicas.

    Thread-safe for ``key_for``/``rotate``/``forget``/``load_keys``;
    ``grant_ranges`` is lock-free (the master's single loop thread calls it
    per reply and segment, so it skips validation and reuses the keyed MAC
    state).
    ``keys()``/``load_keys()`` let the master persist keys so tokens stay
    valid and owners need no new key after a master restart.

    ``epoch`` is written into every token: 0 for a master without HA; an HA
    master sets it to its term's epoch when it is elected, before it signs
    anything in that term (verifiers refuse tokens of an older epoch than
    the newest they have seen).
    """

    def __init__(self, ttl_ms: int = 10_000) -> None:
        if ttl_ms <= 0:
            raise KVPoolError("capability ttl_ms must be > 0", ErrorCode.INVALID_PARAMS)
        self.ttl_ms = ttl_ms
        self._keys: dict[str, bytes] = {}
        # segment id -> (keyed MAC state, utf-8 id, its length) for grant_fast
        self._states: dict[str, tuple[Any, bytes, int]] = {}
        self._lock = threading.Lock()
        # nonces only make two grants of one range distinct: a counter from a
        # random start is enough and saves a getrandom() per token
        self._n0 = self._n = int.from_bytes(os.urandom(8), "big") >> 2
        self.granted_ranges = 0  # ranges covered by the tokens signed
        self.epoch = 0  # the leader term signed into tokens (0: no HA)

    def _install(self, segment_id: str, key: bytes) -> None:
        seg = segment_id.encode()
        if not seg or len(seg) > MAX_SEGMENT_ID_LENGTH:
            raise KVPoolError("capability segment id empty or too long", ErrorCode.INVALID_PARAMS)
        self._keys[segment_id] = key
        self._states[segment_id] = (_mac_state(key), seg, len(seg))

    def key_for(self, segment_id: str) -> bytes:
        """The segment's key, created on first use (hand it to the owner at mount)."""
        with self._lock:
            key = self._keys.get(segment_id)
            if key is None:
                key = new_segment_key()
                self._install(segment_id, key)
            return key

    def rotate(self, segment_id: str) -> bytes:
        """Replace the segment's key with a fresh one (a new mount): tokens
        signed under the old key stop verifying once the owner installs it."""
        with self._lock:
            key = new_segment_key()
            self._install(segment_id, key)
            return key

    def has_key(self, segment_id: str) -> bool:
        return segment_id in self._keys

    def forget(self, segment_id: str) -> None:
        """Drop a segment's key (segment unmounted or its owner declared dead)."""
        with self._lock:
            self._keys.pop(segment_id, None)
            self._states.pop(segment_id, None)

    def expiry(self, ttl_ms: int | None = None) -> int:
        """The expiry (epoch ms) of a grant made now."""
        return wall_clock_ms() + (self.ttl_ms if ttl_ms is None else ttl_ms)

    def grant_ranges(self, segment_id: str, flat: Sequence[int], op: int,
                     expiry_ms: int) -> bytes:
        """One token for ``op`` (int value of CapOp) on every range of ``flat``
        (``offset, length, offset, length, ...``, at most ``MAX_RANGES``
        pairs) until ``expiry_ms``; b"" if the segment has no key. No
        validation: the caller passes values it allocated itself (the
        master's hot path)."""
        st = self._states.get(segment_id)
        if st is None:
            return b""
        self._n += 1
        k = len(flat) >> 1
        self.granted_ranges += k
        body = (_PACK(TOKEN_VERSION, op, st[2], k, expiry_ms, self._n & _U64, self.epoch)
                + st[1] + _ranges_pack(k)(*flat))
        h = st[0].copy()
        h.update(body)
        return body + h.digest()

    def grant_fast(self, segment_id: str, offset: int, length: int, op: int,
                   expiry_ms: int) -> bytes:
        """:meth:`grant_ranges` of one range."""
        return self.grant_ranges(segment_id, (offset, length), op, expiry_ms)

    @property
    def granted(self) -> int:
        """Tokens signed by grant_ranges/grant_fast so far."""
        return self._n - self._n0

    def grant(self, segment_id: str, offset: int, length: int, op: CapOp | Any,
              ttl_ms: int | None = None) -> bytes:
        """A signed token for ``op`` on ``[offset, offset+length)``, valid ``ttl_ms``."""
        cap = Capability.single(segment_id, offset, length, CapOp.coerce(op),
                                self.expiry(ttl_ms), epoch=self.epoch)
        return sign(cap, self.key_for(segment_id))

    def keys(self) -> dict[str, bytes]:
        """A copy of every segment key (for the master's persisted state)."""
        with self._lock:
            return dict(self._keys)

    def load_keys(self, keys: dict[str, bytes]) -> None:
        """Restore keys (existing keys are replaced)."""
        with self._lock:
            for k, v in keys.items():
                if v:
                    self._install(str(k), bytes(v))


class CapabilityVerifier:
    """The transfer server's side: keys of the local segments + refusal counters.

    ``check`` raises :class:`CapabilityError` and counts the refusal by
    reason (``refusals``); ``on_refusal(reason)`` is also called, e.g. to bump
    a Prometheus counter. With ``required=False`` a request without a token
    passes (migration/loopback mode); a token that is present is always checked.

    Verified tokens are kept per segment (the newest ``cache_size``, keyed
    by the whole token, the oldest dropped first in O(1), all dropped when
    the segment's key changes), so the requests of one batch pay for one
    MAC: the rest is a lookup and the epoch, op, expiry and range checks.

    Fencing: ``epoch`` is the highest leader epoch seen, one per verifier
    (a node daemon serves one master group). Authentic tokens and the
    master's ping replies (:meth:`observe_epoch`) raise it; a token of a
    lower epoch is refused with :attr:`DenyReason.STALE_EPOCH`, also when
    it was verified (and cached) before the epoch rose.
    """

    def __init__(
        self,
        required: bool = True,
        leeway_ms: int = 2000,
        on_refusal: Callable[[DenyReason], None] | None = None,
        cache_size: int = 1024,
    ) -> None:
        self.required = required
        self.leeway_ms = leeway_ms
        self.on_refusal = on_refusal
        self.cache_size = cache_size
        self._keys: dict[str, tuple[bytes, Any]] = {}
        # segment id -> {token: verified grant}; replaced, never mutated in
        # place, when the key changes (so a reader never sees a stale grant)
        self._verified: dict[str, OrderedDict[bytes, _Grant]] = {}
        self._lock = threading.Lock()
        self.refusals: dict[DenyReason, int] = dict.fromkeys(DenyReason, 0)
        self.accepted = 0
        self.macs = 0  # tokens whose tag was computed (cache misses)
        self.epoch = 0  # the highest leader epoch seen (only grows)

    def observe_epoch(self, epoch: int) -> bool:
        """Raise the epoch high-water to ``epoch`` (a no-op if not higher);
        True if it rose. Call it only with an epoch the master vouches for
        (an authentic token, the master's reply on the control channel)."""
        if epoch <= self.epoch:
            return False
        with self._lock:
            if epoch <= self.epoch:
                return False
            self.epoch = epoch
        return True

    def set_key(self, segment_id: str, key: bytes) -> None:
        """Install (or replace) the key the master handed over for a local segment."""
        if not key:
            raise KVPoolError("capability key must not be empty", ErrorCode.INVALID_PARAMS)
        key = bytes(key)
        with self._lock:
            self._keys[segment_id] = (key, _mac_state(key))
            self._verified[segment_id] = OrderedDict()

    def remove_key(self, segment_id: str) -> None:
        with self._lock:
            self._keys.pop(segment_id, None)
            self._verified.pop(segment_id, None)

    def has_key(self, segment_id: str) -> bool:
        return segment_id in self._keys

    def _refuse(self, exc: CapabilityError) -> CapabilityError:
        with self._lock:
            self.refusals[exc.reason] += 1
        if self.on_refusal is not None:
            self.on_refusal(exc.reason)
        return exc

    def check_many(self, token: bytes | bytearray | memoryview | None, segment_id: str,
                   offsets: Sequence[int], lengths: Sequence[int], op: CapOp) -> bool:
        """True when ``token`` allows ``op`` on every range ``(offsets[i],
        lengths[i])`` of ``segment_id``: the token is looked up (or verified)
        once, epoch, op and expiry checked once, then one dictionary lookup per
        range. False when any of that fails or a range is not a granted one
        exactly: the caller then checks each range with :meth:`check`, which
        refuses with the reason and counts it (nothing is counted here)."""
        if not token or type(op) is not CapOp:
            return False
        entry = self._keys.get(segment_id)
        if entry is None:
            return False
        tok = token if type(token) is bytes else bytes(token)
        cache = self._verified.get(segment_id)
        grant = cache.get(tok) if cache is not None else None
        if grant is None:
            try:
                grant = self._verify_new(tok, entry, segment_id, cache)
            except CapabilityError:
                return False
        if grant.epoch < self.epoch or grant.op is not op \
                or _time_ns() // 1_000_000 > grant.expiry_ms + self.leeway_ms:
            return False
        exact = grant.exact.get
        for off, n in zip(offsets, lengths, strict=True):
            m = exact(off)
            if m is None or not 0 <= n <= m:
                return False
        self.accepted += len(offsets)  # approximate under threads; informational only
        return True

    def _verify_new(self, tok: bytes, entry: tuple[bytes, Any], segment_id: str,
                    cache: OrderedDict[bytes, _Grant] | None) -> _Grant:
        """A token not in the cache: MAC-verified, its epoch observed, cached."""
        grant = _authentic(tok, entry[1], segment_id)
        self.macs += 1
        if grant.epoch > self.epoch:
            self.observe_epoch(grant.epoch)  # authentic: a term the master vouches for
        if cache is not None and self._keys.get(segment_id) is entry \
                and grant.epoch >= self.epoch:
            if len(cache) >= self.cache_size:
                try:
                    cache.popitem(last=False)  # the oldest, O(1)
                except KeyError:  # emptied by another thread
                    pass
            cache[tok] = grant
        return grant

    def check(self, token: bytes | bytearray | memoryview | None, segment_id: str,
              offset: int, length: int, op: CapOp | Any, required: bool | None = None) -> None:
        """Allow or refuse one request (see :func:`verify` for the rules).
        ``required`` overrides ``self.required`` for this request."""
        if not token:
            if not (self.required if required is None else required):
                return
            raise self._refuse(CapabilityError(DenyReason.MISSING, "no capability presented"))
        entry = self._keys.get(segment_id)
        if entry is None:
            raise self._refuse(CapabilityError(
                DenyReason.NO_KEY, f"no key for segment {segment_id!r} on this server"))
        try:
            want = op if type(op) is CapOp else CapOp.coerce(op)
            tok = token if type(token) is bytes else bytes(token)
            cache = self._verified.get(segment_id)
            grant = cache.get(tok) if cache is not None else None
            if grant is None:
                grant = self._verify_new(tok, entry, segment_id, cache)
            if grant.epoch < self.epoch:
                grant.check_epoch(self.epoch)
            # Grant.check, inlined: this runs once per range of every transfer
            if grant.op is not want:
                raise CapabilityError(DenyReason.WRONG_OP,
                                      f"token allows {grant.op.name}, not {want.name}")
            now = _time_ns() // 1_000_000
            if now > grant.expiry_ms + self.leeway_ms:
                raise CapabilityError(DenyReason.EXPIRED,
                                      f"expired {now - grant.expiry_ms} ms ago")
            n = grant.exact.get(offset)
            if n is None or not 0 <= length <= n:
                grant.check_range(offset, length)
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

"""Reads: locate keys, then one read loop for every read form.

Every read of the store client (``get``, ``get_into``, ``get_batch``,
``batch_get_into``, byte ranges, multi-buffer values, pipelined parts) is
the same two steps:

1. *locate*: one master call answers where each key is (:class:`Location`:
   size, checksum, read-lease deadline, complete replicas nearest first);
2. *read* (:meth:`Reads.read`): round k copies every pending read from its
   object's k-th nearest replica, all of a round in one transfer batch
   (usually one round: one batch for the whole call). A read whose replica
   failed goes to the next round (a segment that failed is tried last for a
   while; a refusal of an older master term's grant is remembered as
   STALE_EPOCH, which callers answer by locating again); a read that ends
   after its lease is LEASE_EXPIRED (the bytes may have been evicted meanwhile).

Results are per read: the bytes read, or a negative :class:`ErrorCode`. Only
the single-key public calls turn a code into an exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    KEY_MIN,
    MAX_KEY_LENGTH,
    BatchGetReplicaListReply,
    ReplicaStatus,
)
from kvpool.store._bufutil import alloc_bytes, buffer_nbytes, host_view, verify_checksum
from kvpool.store.config import ClientConfig
from kvpool.store.errors import BufferTooSmall, StaleEpoch, StoreError, error_for_code
from kvpool.store.located import Location
from kvpool.store.replicas import SUSPECT_S, nearest_first
from kvpool.store.session import MasterSession
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.registry import SegmentRegistry
from kvpool.transfer.types import RequestState, TransferOp, TransferRequest

__all__ = ["RangeRead", "Reads", "code_of", "valid_key"]

log = logging.getLogger(__name__)

_OK = ErrorCode.OK
_COMPLETE = ReplicaStatus.COMPLETE
_READ = TransferOp.READ
_DONE = RequestState.DONE
_STALE = int(ErrorCode.STALE_EPOCH)
_EXPIRED = int(ErrorCode.LEASE_EXPIRED)
_FAILED = int(ErrorCode.TRANSFER_FAIL)
_UNREAD = int(ErrorCode.INTERNAL_ERROR)  # a read's result before it is decided
_INF = float("inf")
_U8 = np.dtype(np.uint8)
_SMALL_GET = 64 << 10  # get(): below this, read into numpy and copy into bytes
_STR_ONLY = {str}


def valid_key(key: Any) -> bool:
    """Whether ``key`` may name an object: a str of at most MAX_KEY_LENGTH,
    not empty and not starting below ``KEY_MIN`` (the master's reserved and
    tenant-namespace prefixes; the master refuses those too)."""
    return type(key) is str and key >= KEY_MIN and len(key) <= MAX_KEY_LENGTH


def all_valid_keys(keys: Sequence[Any]) -> bool:
    """Whether every one of (non-empty) ``keys`` is :func:`valid_key` (by C
    callables mapped over them: no Python frame per key)."""
    return set(map(type, keys)) == _STR_ONLY and min(keys) >= KEY_MIN \
        and max(map(len, keys)) <= MAX_KEY_LENGTH


class RangeRead(msgspec.Struct):
    """Read ``length`` bytes from ``src_offset`` of a located object into the
    start of ``buffer``."""

    location: Location
    buffer: Any
    src_offset: int
    length: int


class Reads:
    """Locating and reading for one client (module docstring)."""

    def __init__(self, session: MasterSession, engine: Any, config: ClientConfig) -> None:
        self.session = session
        self.engine = engine
        self.registry: SegmentRegistry = engine.registry
        self.config = config

    # ------------------------------------------------------------------ locating

    def locate(self, keys: Sequence[str]) -> list[Location]:
        """Where each key can be read from: one master call for the valid
        keys (it grants their read leases); an invalid key is INVALID_KEY."""
        self.session.check()
        n = len(keys)
        if n and all_valid_keys(keys):
            res, deadline = self.session.locate(list(keys))
            return self.locations(res, deadline)
        out = [Location(ErrorCode.INVALID_KEY) for _ in range(n)]
        valid = [i for i, k in enumerate(keys) if valid_key(k)]
        if valid:
            res, deadline = self.session.locate([keys[i] for i in valid])
            for i, loc in zip(valid, self.locations(res, deadline), strict=True):
                out[i] = loc
        return out

    def locations(self, res: BatchGetReplicaListReply, deadline: float,
                  positions: Sequence[int] | None = None) -> list[Location]:
        """The Locations of a BATCH_GET_REPLICA_LIST reply (of ``positions``
        in it, default all), its segments learned."""
        if res.segments:
            self.registry.learn(res.segments)
        codes, sizes, replicas, checksums, caps = (res.codes, res.sizes, res.replicas,
                                                   res.checksums, res.caps)
        registry = self.registry
        out = []
        for pos in range(len(codes)) if positions is None else positions:
            code = codes[pos]
            if code:
                out.append(Location(code_of(code)))
                continue
            reps = replicas[pos]
            if len(reps) != 1 or reps[0].status is not _COMPLETE:
                reps = nearest_first(registry, reps)
                if not reps:
                    out.append(Location(ErrorCode.OBJECT_NOT_FOUND))
                    continue
            checksum = checksums[pos] if checksums else None
            out.append(Location(_OK, sizes[pos], checksum if type(checksum) is str else None,
                                deadline, reps, caps))
        return out

    # ------------------------------------------------------------------ the loop

    def read(self, locs: Sequence[Location], bufs: Sequence[Any],
             offs: Sequence[int] | None = None, lens: Sequence[int] | None = None,
             verify: bool = False, errors: list[str] | None = None) -> list[int]:
        """Read ``lens[j]`` bytes at ``offs[j]`` of object ``locs[j]`` into the
        start of ``bufs[j]`` (``offs``/``lens`` None: whole objects; the caller
        checked that each buffer holds them). Per read the bytes read or a
        negative code: the location's own, INVALID_PARAMS (a range outside
        the object or larger than its buffer), LEASE_EXPIRED, TRANSFER_FAIL
        (every replica failed), STALE_EPOCH (refused as a grant of an older
        master term: locate again), CHECKSUM_MISMATCH (``verify``: a whole
        object whose recorded checksum does not match). ``errors`` collects
        the failed attempts' messages."""
        n = len(locs)
        results = [_UNREAD] * n
        pending: list[int] = []
        whole = offs is None
        for j in range(n):
            loc = locs[j]
            if loc.code:
                results[j] = int(loc.code)
                continue
            if not whole:
                assert offs is not None and lens is not None
                off, length = offs[j], lens[j]
                if off < 0 or length < 0 or off + length > loc.size \
                        or buffer_nbytes(bufs[j]) < length:
                    results[j] = int(ErrorCode.INVALID_PARAMS)
                    continue
                if length == 0:
                    results[j] = 0
                    continue
            pending.append(j)
        attempt = 0
        stale: set[int] | None = None  # (made at the first refusal)
        run = self.engine.run
        verify = verify and self.config.verify_checksum
        while pending:
            now = time.monotonic()
            reqs: list[TransferRequest] = []
            owners: list[int] = []
            first_deadline = _INF
            left = 1  # the most replicas a read has left to try, this one included
            for j in pending:
                loc = locs[j]
                reps = loc.replicas
                deadline = loc.deadline
                if deadline <= now:
                    results[j] = _EXPIRED
                    continue
                more = len(reps) - attempt
                if more <= 0:
                    results[j] = _STALE if stale is not None and j in stale else _FAILED
                    continue
                if more > left:
                    left = more
                if deadline < first_deadline:
                    first_deadline = deadline
                r = reps[attempt]
                k = r.cap
                reqs.append(TransferRequest(
                    _READ, bufs[j], r.segment_id,
                    r.offset if whole else r.offset + offs[j],  # type: ignore[index]
                    loc.size if whole else lens[j],  # type: ignore[index]
                    0, None, loc.caps[k] if k >= 0 else b""))
                owners.append(j)
            if not reqs:
                break
            # leave the replicas after this one a share of the lease: a dead
            # peer must not use up all of it
            timeout = (first_deadline - now) / left
            if timeout > self.config.transfer_timeout_s:
                timeout = self.config.transfer_timeout_s
            statuses = run(reqs, timeout if timeout > 0.001 else 0.001)
            end = time.monotonic()
            pending = []
            late = end > first_deadline  # some read may have ended after its lease
            for req, j, st in zip(reqs, owners, statuses, strict=True):
                if st.state is not _DONE:
                    if errors is not None:
                        errors.append(f"{req.segment_id}: " + ("; ".join(st.errors)
                                                               or st.code.name))
                    if st.code == ErrorCode.STALE_EPOCH:
                        if stale is None:
                            stale = set()
                        stale.add(j)  # the node is fine: the grant is of an older term
                    else:
                        self.registry.suspect(req.segment_id, SUSPECT_S)
                    pending.append(j)
                elif late and end > locs[j].deadline:
                    results[j] = _EXPIRED
                elif verify and locs[j].checksum is not None:
                    results[j] = self._verified(locs[j], bufs[j])
                else:
                    results[j] = req.length
            attempt += 1
        return results

    @staticmethod
    def _verified(loc: Location, buf: Any) -> int:
        """A whole object read into ``buf``: its size, or CHECKSUM_MISMATCH."""
        if not isinstance(loc.checksum, str):
            return loc.size
        view = host_view(buf)
        if view is None:
            return loc.size  # GPU memory: verifying would cost a device->host copy
        if verify_checksum(loc.checksum, view[:loc.size]) is False:
            return int(ErrorCode.CHECKSUM_MISMATCH)
        return loc.size

    # ------------------------------------------------------------------ single keys

    def get(self, key: str) -> bytes:
        """The value of ``key`` (exceptions as :meth:`Client.get`)."""
        for retry in (False, True):
            loc = self.locate_one(key)
            size = loc.size
            if size < _SMALL_GET:  # an extra small memcpy costs less than wrapping bytes
                arr = np.empty(size, _U8)  # (positional: keywords cost more here)
                code = self._read_one(key, loc, BufferHandle(None, size, "cpu", 0, False, arr, arr),
                                      retry)
                if code is not None:
                    return arr.tobytes()
            else:
                out, target = alloc_bytes(size)
                if self._read_one(key, loc, target, retry) is not None:
                    return out
        raise AssertionError("unreachable")

    def get_into(self, key: str, buffer: Any) -> int:
        """Read ``key`` into ``buffer`` (exceptions as :meth:`Client.get_into`)."""
        cap = buffer_nbytes(buffer)
        for retry in (False, True):
            loc = self.locate_one(key)
            if cap < loc.size:
                raise BufferTooSmall(f"{key!r} is {loc.size} bytes; buffer holds {cap}")
            got = self._read_one(key, loc, buffer, retry)
            if got is not None:
                return got
        raise AssertionError("unreachable")

    def locate_one(self, key: str) -> Location:
        """``key`` located; raises the error of its code (ObjectNotFound...)."""
        if not valid_key(key):
            raise StoreError(f"invalid key {key!r}", ErrorCode.INVALID_KEY)
        self.session.check()
        loc = self.locations(*self.session.locate([key]))[0]  # (locate(), the key checked)
        if loc.code:
            raise error_for_code(loc.code, f"{key!r}: {loc.code.name}")
        return loc

    def _read_one(self, key: str, loc: Location, buffer: Any, retry: bool) -> int | None:
        """Read one located key: its size; None when refused as a grant of an
        older master term the first time (the caller locates again); raises
        the error of any other failure."""
        errors: list[str] = []
        code = self.read([loc], [buffer], verify=True, errors=errors)[0]
        if code >= 0:
            return code
        if code == _STALE:
            exc = StaleEpoch(f"get {key!r}: refused as a grant of an older master term: "
                             + " | ".join(errors))
            if retry:
                raise exc
            log.info("%s; asking the master again", exc)
            return None
        if code == _EXPIRED:
            raise error_for_code(code, f"read lease of {key!r} expired; bytes discarded"
                                 + (": " + " | ".join(errors) if errors else ""))
        if code == ErrorCode.TRANSFER_FAIL:
            raise error_for_code(code, f"get {key!r}: every replica failed: "
                                 + " | ".join(errors))
        raise error_for_code(code, f"{key!r}: {ErrorCode(code).name}")

    # ------------------------------------------------------------------ batches

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Read many keys into their buffers: per key the bytes read or a
        negative code (BUFFER_OVERFLOW for a buffer smaller than the object).
        Keys refused as grants of an older master term are located and read
        once more."""
        if len(keys) != len(buffers):
            raise StoreError(f"{len(keys)} keys but {len(buffers)} buffers",
                             ErrorCode.INVALID_PARAMS)
        locs = self.locate(keys)
        results = self._read_into(locs, buffers)
        stale = [i for i, r in enumerate(results) if r == _STALE]
        if stale:  # a failover: the current leader grants afresh
            log.info("%d key(s) refused as of an older master term; asking again", len(stale))
            again = self._read_into(self.locate([keys[i] for i in stale]),
                                    [buffers[i] for i in stale])
            for i, r in zip(stale, again, strict=True):
                results[i] = r
        return results

    def _read_into(self, locs: list[Location], buffers: Sequence[Any]) -> list[int]:
        """Whole objects into ``buffers`` (BUFFER_OVERFLOW where one is too small)."""
        for i, loc in enumerate(locs):
            if loc.code is _OK:
                buf = buffers[i]
                if (buf.length if type(buf) is BufferHandle else buffer_nbytes(buf)) < loc.size:
                    locs[i] = Location(ErrorCode.BUFFER_OVERFLOW)
        return self.read(locs, buffers, verify=True)

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of many keys (None where missing or unreadable)."""
        self.session.check()
        locs = self.locate(keys)
        outs: list[Any] = [None] * len(keys)
        targets: list[Any] = [None] * len(keys)
        for i, loc in enumerate(locs):
            if loc.code is not _OK:
                continue
            size = loc.size
            if size < _SMALL_GET:  # as get(): an array, copied into bytes after
                arr = outs[i] = np.empty(size, _U8)
                targets[i] = BufferHandle(None, size, "cpu", 0, False, arr, arr)
            else:
                outs[i], targets[i] = alloc_bytes(size)
        results = self.read(locs, targets, verify=True)
        return [None if r < 0 else out if type(out) is bytes else out.tobytes()
                for out, r in zip(outs, results, strict=True)]

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[int]:
        """:meth:`read` of byte ranges of located objects (no master call)."""
        self.session.check()
        return self.read([r.location for r in reads], [r.buffer for r in reads],
                         [r.src_offset for r in reads], [r.length for r in reads])

    def batch_get_ranges(self, fragments: Sequence[tuple[str, Any, int, int]]) -> list[int]:
        """Read ``(key, buffer, src_offset, length)`` fragments: one master call
        for the distinct keys, one read loop."""
        keys = list(dict.fromkeys(f[0] for f in fragments))
        if not keys:
            return []
        where = dict(zip(keys, self.locate(keys), strict=True))
        return self.read([where[f[0]] for f in fragments], [f[1] for f in fragments],
                         [int(f[2]) for f in fragments], [int(f[3]) for f in fragments])


def code_of(code: Any) -> ErrorCode:
    """A master's per-key code as an ErrorCode (INTERNAL_ERROR if unknown)."""
    try:
        return ErrorCode(int(code))
    except ValueError:
        return ErrorCode.INTERNAL_ERROR


"""Writes: the one put path of the store client.

Every put is a batch (a single put is a batch of one key):

1. *start*: the master allocates every replica of each new key (PUT_START or
   BATCH_PUT_START, UPSERT_START / BATCH_UPSERT_START to replace) and grants
   WRITE capabilities; or the put takes spare allocations its previous commit
   was handed (:mod:`kvpool.store.spares`) and skips this round trip;
2. *write*: one transfer batch writes every replica of every key;
3. *end*: the keys whose writes all landed are committed (PUT_END /
   BATCH_PUT_END, or PUT_COMMIT / BATCH_PUT_COMMIT naming the spares), the
   others revoked. A commit of one size asks for spares for the next put.

Across an HA failover: a grant of an older master term refused by a node
(STALE_EPOCH) is revoked and the key put again once; a commit that reaches
a new leader which never heard of the grant (OBJECT_NOT_FOUND; for an upsert
any answer) is put again once at the new leader (the old allocation was the
old term's). The wire call for one key is the single-key op, for more the
batch op; results are per key (:class:`ErrorCode`), turned into exceptions
only by the single-key public calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    BatchPutCommit,
    BatchPutEnd,
    BatchPutStart,
    BatchUpsertStart,
    Checksum,
    PutCommit,
    PutEnd,
    PutOptions,
    PutStart,
    ReplicaDescriptor,
    UpsertStart,
)
from kvpool.store._bufutil import buffer_nbytes, checksum_of, host_view, resolve_checksum_algo
from kvpool.store.config import ClientConfig, ReplicateConfig, SoftPinAction
from kvpool.store.errors import (
    MasterUnreachable,
    StoreError,
    StoreTimeout,
    TransferFailed,
    error_for_code,
)
from kvpool.store.reads import all_valid_keys, code_of, valid_key
from kvpool.store.replicas import SUSPECT_S
from kvpool.store.session import MasterSession
from kvpool.store.spares import Spare, SpareCache
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.types import RequestState, TransferOp, TransferRequest

__all__ = ["RangeWrite", "Reservation", "Writes", "put_options"]

log = logging.getLogger(__name__)

_OK = ErrorCode.OK
_WRITE = TransferOp.WRITE
_DONE = RequestState.DONE
_HANDLE_ONLY = {BufferHandle}
_DEFAULT_OPTIONS = PutOptions()
# what a master answers about one key rather than about the call (single-key ops)
_CALL_CODES = frozenset({ErrorCode.RPC_FAIL, ErrorCode.RPC_TIMEOUT, ErrorCode.CLOSED,
                         ErrorCode.WRITE_OUTCOME_UNKNOWN, ErrorCode.NOT_LEADER,
                         ErrorCode.NO_LEADER, ErrorCode.COORDINATION_UNAVAILABLE,
                         ErrorCode.NOT_ENOUGH_STANDBYS,
                         ErrorCode.TOO_MANY_REQUESTS, ErrorCode.TIMEOUT})


@dataclass(slots=True)
class Reservation:
    """One key of :meth:`Writes.grant` (``Client.batch_put_reserve``): ``code``
    OK with the ``replicas`` to write ``size`` bytes into and the capability
    tokens (``caps``) they point at, or why not."""

    code: ErrorCode
    size: int
    replicas: list[ReplicaDescriptor]
    caps: list[bytes]


@dataclass(slots=True)
class RangeWrite:
    """Write ``length`` bytes of ``buffer`` (None: all of it) at ``offset`` of
    every replica of a granted object (``caps``: its grant's tokens)."""

    buffer: Any
    replicas: list[ReplicaDescriptor]
    offset: int = 0
    length: int | None = None
    caps: list[bytes] = field(default_factory=list)

    def nbytes(self) -> int:
        return buffer_nbytes(self.buffer) if self.length is None else self.length


def put_options(config: ReplicateConfig | None) -> PutOptions | None:
    """The placement a replicate config stands for (None: every default)."""
    if config is None:
        return None
    soft = bool(config.pins_soft)
    ttl = config.soft_pin_ttl_ms
    opts = PutOptions(int(config.replica_num),
                      int(config.disk_replica_num) + int(config.nof_replica_num),
                      config.segments(), bool(config.with_hard_pin), soft,
                      int(ttl) if soft and ttl is not None else -1,
                      not soft and config.soft_pin_action == SoftPinAction.DISABLE)
    return None if opts == _DEFAULT_OPTIONS else opts


def config_for(config: ReplicateConfig | None, idx: Sequence[int]) -> ReplicateConfig | None:
    """``config`` for the keys at ``idx`` of a batch (``group_ids`` picked)."""
    if config is None or config.group_ids is None:
        return config
    return replace(config, group_ids=[config.group_ids[i] for i in idx])


class Writes:
    """The put path of one client (module docstring)."""

    def __init__(self, session: MasterSession, engine: Any, config: ClientConfig) -> None:
        self.session = session
        self.engine = engine
        self.registry = engine.registry
        self.config = config
        self.client_id = session.client_id
        self.checksum_algo = resolve_checksum_algo(config.checksum)
        self.spares = SpareCache(session, config.reserve_max_bytes)

    # ------------------------------------------------------------------ puts

    def put(self, key: str, buffer: Any, config: ReplicateConfig | None) -> None:
        """Put one key; raises the error of its code (see Client.put_from)."""
        errors: dict[int, str] = {}
        code = self.put_many([key], [buffer], config, errors=errors)[0]
        if code:
            # (put_many checks the key and the size: named here, where it failed)
            if code == ErrorCode.INVALID_KEY:
                raise StoreError(f"invalid key {key!r}", code)
            if code == ErrorCode.INVALID_PARAMS and buffer_nbytes(buffer) <= 0:
                raise StoreError("cannot put an empty value", code)
            why = errors.get(0) or code.name
            if code == ErrorCode.QUOTA_EXCEEDED:
                why = (f"tenant {self.config.tenant!r} is at its quota and no room could be "
                       f"made by evicting its own objects (leased or pinned, or the value "
                       f"exceeds the quota); nothing stored ({why})")
            raise error_for_code(code, f"put {key!r}: {why}")

    def put_many(self, keys: Sequence[str], buffers: Sequence[Any],
                 config: ReplicateConfig | None = None, upsert: bool = False,
                 spares: bool = True, retry: bool = True,
                 errors: dict[int, str] | None = None) -> list[ErrorCode]:
        """Put ``keys[i]`` = ``buffers[i]``; per key OK or why not (INVALID_KEY,
        OBJECT_ALREADY_EXISTS (also a key twice in the batch), INVALID_PARAMS
        for an empty buffer, NO_AVAILABLE_HANDLE, TRANSFER_FAIL, STALE_EPOCH...).
        ``spares``: may use and ask for spare allocations; ``retry``: a key
        refused as an older term's grant is put again once; ``errors`` gets a
        message per failed key. Raises only for call-level failures."""
        self.session.check()
        n = len(keys)
        if n != len(buffers):
            raise StoreError(f"{n} keys but {len(buffers)} buffers", ErrorCode.INVALID_PARAMS)
        codes: list[ErrorCode] = [_OK] * n
        if n == 0:
            return codes
        groups = None if config is None else self._groups(config, n)
        checked = self.checksum_algo is not None
        idx: Sequence[int]
        sizes: list[int] | None = None
        # (the key checks map C callables: no Python frame per key)
        if checked:
            pass
        elif n == 1:
            key = keys[0]
            if valid_key(key):
                sizes = [buffer_nbytes(buffers[0])]
        elif all_valid_keys(keys) and len(set(keys)) == n:
            sizes = list(map(buffer_nbytes, buffers)) \
                if set(map(type, buffers)) != _HANDLE_ONLY else [b.length for b in buffers]
        checksums: list[Checksum] | None = None
        if sizes is not None and min(sizes) > 0:  # every key valid and distinct, every value
            idx, put_keys, put_sizes = range(n), list(keys), sizes
        else:
            idx, put_keys, put_sizes = self._checked(
                keys, list(map(buffer_nbytes, buffers)) if sizes is None else sizes, codes)
            if not idx:
                return codes
            if checked:
                checksums = [self.checksum(buffers[i]) for i in idx]
        opts = None if config is None else put_options(config)
        # one size, every default: spares skip the start, or are asked of the commit
        spare_size = 0
        enabled = self.config.reserve_batch_puts if n > 1 else self.config.reserve_single_puts
        if spares and enabled and not upsert and checksums is None and groups is None \
                and opts is None and type(idx) is range:
            size = put_sizes[0]
            if size * n <= self.spares.max_bytes and put_sizes.count(size) == n:
                spare_size = size if self.spares.may_ask(size, n) else 0
                held = self.spares.take(size, n)
                if held is not None:
                    return self._put_spared(put_keys, buffers, size, held, config, errors)
        got = self._put_started(put_keys, [buffers[i] for i in idx] if type(idx) is not range
                                else buffers, put_sizes, opts, checksums,
                                None if groups is None else [groups[i] for i in idx], upsert,
                                spare_size, config_for(config, idx) if groups else config,
                                retry, errors)
        if type(idx) is range:
            return got
        for pos, i in enumerate(idx):
            codes[i] = got[pos]
            if errors is not None and pos in errors:
                errors[i] = errors.pop(pos)
        return codes

    @staticmethod
    def _checked(keys: Sequence[str], sizes: Sequence[int], codes: list[ErrorCode]
                 ) -> tuple[list[int], list[str], list[int]]:
        """The keys of a put that go to the master, checked one by one:
        their positions, keys and sizes; sets ``codes`` of the others:
        INVALID_KEY, OBJECT_ALREADY_EXISTS for a repeat in the batch,
        INVALID_PARAMS for an empty value."""
        idx: list[int] = []
        put_keys: list[str] = []
        put_sizes: list[int] = []
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if not valid_key(key):
                codes[i] = ErrorCode.INVALID_KEY
                continue
            if key in seen:
                codes[i] = ErrorCode.OBJECT_ALREADY_EXISTS
                continue
            if sizes[i] <= 0:
                codes[i] = ErrorCode.INVALID_PARAMS
                continue
            seen.add(key)
            idx.append(i)
            put_keys.append(key)
            put_sizes.append(sizes[i])
        return idx, put_keys, put_sizes

    def checksum(self, buf: Any) -> str | None:
        """The configured checksum of a host buffer (None: off, or GPU memory)."""
        if self.checksum_algo is None:
            return None
        view = host_view(buf)
        return None if view is None else checksum_of(self.checksum_algo, view)

    @staticmethod
    def _groups(config: ReplicateConfig | None, n: int) -> list[str] | None:
        """``config.group_ids`` (one object group per key) checked against ``n`` keys."""
        if config is None or config.group_ids is None:
            return None
        groups = [str(g) for g in config.group_ids]
        if len(groups) != n:
            raise StoreError(f"group_ids has {len(groups)} entries for {n} keys",
                             ErrorCode.INVALID_PARAMS)
        return groups

    def _put_started(self, keys: list[str], buffers: Sequence[Any], sizes: list[int],
                     opts: PutOptions | None, checksums: list[Checksum] | None,
                     groups: list[str] | None, upsert: bool, spare_size: int,
                     config: ReplicateConfig | None, retry: bool,
                     errors: dict[int, str] | None) -> list[ErrorCode]:
        """Start, write and end ``keys`` (valid, distinct, non-empty)."""
        codes, replicas, caps = self.start(keys, sizes, opts, checksums, groups, upsert, errors)
        term = self.session.term
        granted = [p for p, c in enumerate(codes) if not c]
        if not granted:
            return codes
        try:
            wrote = self._write(granted, buffers, sizes, replicas, [caps] * len(keys), None,
                                errors)
        except BaseException:
            self.session.revoke([keys[p] for p in granted])
            raise
        failed = [p for p, c in zip(granted, wrote, strict=True) if c]
        if failed:
            self.session.revoke([keys[p] for p in failed])
            for p, c in zip(granted, wrote, strict=True):
                if c:
                    codes[p] = c
            granted = [p for p in granted if not codes[p]]
        stale = [p for p in failed if codes[p] == ErrorCode.STALE_EPOCH] if retry else []
        if stale:  # a failover: the current leader grants afresh
            log.info("%d put(s) refused as grants of an older master term; asking again",
                     len(stale))
            again = self.put_many([keys[p] for p in stale], [buffers[p] for p in stale],
                                  config_for(config, stale), upsert, False, False, None)
            for p, c in zip(stale, again, strict=True):
                codes[p] = c
        if granted:
            every = len(granted) == len(keys)
            ends = self.end([keys[p] for p in granted], term, upsert,
                            lambda lost: self.put_many(
                                [keys[granted[q]] for q in lost],
                                [buffers[granted[q]] for q in lost],
                                config_for(config, [granted[q] for q in lost]), upsert),
                            spare_size if every and not failed else 0, errors)
            for p, c in zip(granted, ends, strict=True):
                codes[p] = c
        return codes

    # ------------------------------------------------------------------ the three steps

    def start(self, keys: list[str], sizes: list[int], opts: PutOptions | None,
              checksums: list[Checksum] | None, groups: list[str] | None, upsert: bool,
              errors: dict[int, str] | None = None
              ) -> tuple[list[ErrorCode], list[list[ReplicaDescriptor]], list[bytes]]:
        """Allocate ``keys``: per key a code, the replicas to write, and the
        capability tokens they point at (the segments named are learned)."""
        if len(keys) == 1:
            start1 = UpsertStart if upsert else PutStart
            try:
                one = self.session.call(start1(self.client_id, keys[0], sizes[0], opts,
                                               checksums[0] if checksums else None,
                                               groups[0] if groups else None))
            except StoreError as exc:
                if exc.code in _CALL_CODES:
                    raise
                if errors is not None:
                    errors[0] = str(exc.args[0]) if exc.args else exc.code.name
                return [exc.code], [[]], []
            if one.segments:
                self.registry.learn(one.segments)
            if not one.replicas:  # nothing to write to: give the allocation back
                self.session.revoke(keys)
                return [ErrorCode.NO_AVAILABLE_HANDLE], [[]], one.caps
            return [_OK], [one.replicas], one.caps
        start = BatchUpsertStart if upsert else BatchPutStart
        res = self.session.call(start(self.client_id, keys, sizes, opts,
                                      checksums if checksums and any(
                                          c is not None for c in checksums) else None, groups))
        if res.segments:
            self.registry.learn(res.segments)
        if not any(res.codes):
            codes = [_OK] * len(keys)
        else:
            codes = [code_of(c) for c in res.codes]
        empty = [p for p, reps in enumerate(res.replicas) if not codes[p] and not reps]
        if empty:  # nothing to write to: give those allocations back
            for p in empty:
                codes[p] = ErrorCode.NO_AVAILABLE_HANDLE
            self.session.revoke([keys[p] for p in empty])
        return codes, res.replicas, res.caps

    def _write(self, positions: Sequence[int], buffers: Sequence[Any], sizes: Sequence[int],
               replicas: Sequence[list[ReplicaDescriptor]], caps: Sequence[list[bytes]],
               offsets: Sequence[int] | None, errors: dict[int, str] | None,
               timeout: float | None = None) -> list[ErrorCode]:
        """Write ``buffers[p]`` (``sizes[p]`` bytes, at ``offsets[p]`` of the
        object; default 0) into every replica of ``replicas[p]`` (whose
        tokens are ``caps[p]``) for each position: one transfer batch. Per
        position OK, TRANSFER_FAIL or STALE_EPOCH (refused as an older term's
        grant); ``errors`` gets the failed replicas' messages."""
        reqs: list[TransferRequest] = []
        owner: list[int] = []
        for p in positions:
            buf, size, tokens = buffers[p], sizes[p], caps[p]
            at = 0 if offsets is None else offsets[p]
            for r in replicas[p]:
                k = r.cap
                reqs.append(TransferRequest(_WRITE, buf, r.segment_id, r.offset + at, size, 0,
                                            None, tokens[k] if k >= 0 else b""))
                owner.append(p)
        if not reqs:
            return [_OK] * len(positions)
        statuses = self.transfer(reqs, timeout)
        if statuses[0].state is _DONE and statuses.count(statuses[0]) == len(statuses):
            # (every write served at once: the engine hands them one status object)
            return [_OK] * len(positions)
        bad: dict[int, ErrorCode] = {}
        for req, p, st in zip(reqs, owner, statuses, strict=True):
            if st.ok:
                continue
            stale = st.code == ErrorCode.STALE_EPOCH
            if not stale:
                self.registry.suspect(req.segment_id, SUSPECT_S)
            if p not in bad or stale:
                bad[p] = ErrorCode.STALE_EPOCH if stale else ErrorCode.TRANSFER_FAIL
            if errors is not None:
                msg = f"{req.segment_id}: " + ("; ".join(st.errors) or st.code.name)
                errors[p] = f"{errors[p]} | {msg}" if p in errors else msg
        return [bad.get(p, _OK) for p in positions]

    def transfer(self, reqs: list[TransferRequest], timeout: float | None = None) -> list[Any]:
        """One write batch within ``timeout`` (default ``transfer_timeout_s``):
        StoreTimeout when it overruns, TransferFailed for an engine failure."""
        timeout = timeout or self.config.transfer_timeout_s
        try:
            return self.engine.transfer(reqs, timeout)  # type: ignore[no-any-return]
        except KVPoolError as exc:
            if exc.code in (ErrorCode.TIMEOUT, ErrorCode.RPC_TIMEOUT):
                raise StoreTimeout(f"transfer did not finish within {timeout:.1f}s",
                                   exc.code) from exc
            raise TransferFailed(str(exc), ErrorCode.TRANSFER_FAIL) from exc

    def end(self, keys: list[str], term: int, upsert: bool,
            redo: Callable[[list[int]], list[ErrorCode]], spare_size: int = 0,
            errors: dict[int, str] | None = None) -> list[ErrorCode]:
        """Commit ``keys``, granted in master term ``term``; per key OK or why
        not. When the commit reached another term's leader, the keys it
        answered OBJECT_NOT_FOUND (every committed key of an upsert) are put
        again by ``redo(positions)``, once. ``spare_size`` > 0: ask for spares
        of that size for the next put of as many keys."""
        session = self.session
        if len(keys) == 1:
            try:
                one = session.send_commit(PutEnd(self.client_id, keys[0], spare_size))
            except StoreError as exc:
                if exc.code in _CALL_CODES:
                    raise
                codes = [exc.code]
                if errors is not None:
                    errors[0] = str(exc.args[0]) if exc.args else exc.code.name
            else:
                codes = [_OK]
                if one.placeholder:
                    self.spares.keep(spare_size, [one.placeholder], one.replicas, one.caps,
                                     one.ttl_ms, session.term)
        else:
            end = session.send_commit(BatchPutEnd(self.client_id, keys, spare_size,
                                                  len(keys) if spare_size else 0))
            if end.placeholders:  # granted by the leader that answered
                self.spares.keep(spare_size, end.placeholders, end.replicas, end.caps,
                                 end.ttl_ms, session.term)
            codes = [_OK] * len(keys) if not any(end.codes) else \
                [code_of(c) for c in end.codes]
        lost = [p for p, c in enumerate(codes)
                if c == ErrorCode.OBJECT_NOT_FOUND or (upsert and c == _OK)]
        if not lost or not session.term_changed(term):
            return codes
        log.info("%d of %d puts granted in master term %d committed in term %d: "
                 "putting them again", len(lost), len(keys), term, session.term)
        with session.redoing():
            again = redo(lost)
        for p, c in zip(lost, again, strict=True):
            codes[p] = c
        return codes

    # ------------------------------------------------------------------ spares

    def _put_spared(self, keys: list[str], buffers: Sequence[Any], size: int, spare: Spare,
                    config: ReplicateConfig | None, errors: dict[int, str] | None
                    ) -> list[ErrorCode]:
        """Put ``keys`` (valid, distinct, every value ``size`` bytes) through
        ``spare`` (one allocation per key): the write, then PUT_COMMIT /
        BATCH_PUT_COMMIT asking for the next spares. Keys whose write failed
        or whose spare the master no longer holds are put from the start; a
        key that exists keeps its value (OBJECT_ALREADY_EXISTS) and its spare
        goes back to the cache."""
        n = len(keys)
        placeholders = spare.placeholders
        reps = [[r] for r in spare.replicas]
        try:
            wrote = self._write(range(n), buffers, [size] * n, reps, [spare.caps] * n, None,
                                None)
        except BaseException:
            self.spares.give_back(placeholders)
            raise
        if any(wrote):
            again = [j for j in range(n) if wrote[j]]
            log.info("put: %d writes into spare allocations failed; putting them from the "
                     "start", len(again))
            self.spares.give_back([placeholders[j] for j in again])
            go = [j for j in range(n) if not wrote[j]]
        else:  # every write landed
            again, go = [], list(range(n))
        codes: list[ErrorCode] = [_OK] * n
        if go:
            ends = self._commit_spares(keys if not again else [keys[j] for j in go],
                                       placeholders if not again else
                                       [placeholders[j] for j in go], size)
            taken: list[int] = []
            for j, c in zip(go, ends, strict=True):
                if c == ErrorCode.OBJECT_NOT_FOUND:  # expired or lost: put again
                    again.append(j)
                elif c:
                    codes[j] = c
                    if c == ErrorCode.OBJECT_ALREADY_EXISTS:  # still reserved: reusable
                        taken.append(j)
            if taken:
                self.spares.put_back(size, Spare([placeholders[j] for j in taken],
                                                 [spare.replicas[j] for j in taken],
                                                 spare.caps, spare.deadline, spare.term))
        if again:
            again.sort()
            redo = self.put_many([keys[j] for j in again], [buffers[j] for j in again],
                                 config_for(config, again), spares=False,
                                 errors=errors if n == 1 else None)
            for j, c in zip(again, redo, strict=True):
                codes[j] = c
        return codes

    def _commit_spares(self, keys: list[str], placeholders: list[str], size: int
                       ) -> list[ErrorCode]:
        """Name spares ``placeholders`` as ``keys`` (asking for the next
        spares); an answer lost with the leader's write window
        (WRITE_OUTCOME_UNKNOWN) is confirmed with the keys' PUT_END (OK when
        committed, OBJECT_NOT_FOUND when not applied)."""
        session = self.session
        ask = size if self.spares.may_ask(size, len(keys)) else 0  # the next spares
        try:
            if len(keys) == 1:
                try:
                    one = session.call(PutCommit(self.client_id, placeholders[0], keys[0], ask))
                except StoreError as exc:
                    if exc.code in _CALL_CODES:
                        raise
                    return [exc.code]
                self.spares.keep(size, [one.placeholder] if one.placeholder else [],
                                 one.replicas, one.caps, one.ttl_ms, session.term)
                return [_OK]
            end = session.call(BatchPutCommit(self.client_id, placeholders, keys, ask,
                                              len(keys) if ask else 0))
        except MasterUnreachable as exc:
            if exc.code != ErrorCode.WRITE_OUTCOME_UNKNOWN:
                raise
            log.info("commit of %d spare(s): %s; confirming with the keys' PUT_END",
                     len(keys), exc)
            return self.end(keys, 0, False, lambda lost: [], 0)
        if end.placeholders:
            self.spares.keep(size, end.placeholders, end.replicas, end.caps, end.ttl_ms,
                             session.term)
        return [_OK] * len(keys) if not any(end.codes) else [code_of(c) for c in end.codes]

    # ------------------------------------------------------------------ grants and ranges

    def grant(self, keys: Sequence[str], sizes: Sequence[int],
              config: ReplicateConfig | None = None,
              checksums: Sequence[Checksum] | None = None,
              upsert: bool = False) -> list[Reservation]:
        """Allocate ``sizes[i]`` bytes for ``keys[i]`` on every replica,
        moving no data (see Client.batch_put_reserve)."""
        self.session.check()
        if len(keys) != len(sizes) or (checksums is not None and len(checksums) != len(keys)):
            raise StoreError(f"{len(keys)} keys but {len(sizes)} sizes", ErrorCode.INVALID_PARAMS)
        out = [Reservation(_OK, int(size), [], []) for size in sizes]
        groups = self._groups(config, len(keys))
        codes: list[ErrorCode] = [_OK] * len(keys)
        idx, put_keys, put_sizes = self._checked(keys, [int(s) for s in sizes], codes)
        for i, c in enumerate(codes):
            out[i].code = c
        if not idx:
            return out
        sums = [checksums[i] for i in idx] if checksums is not None else []
        got, replicas, caps = self.start(put_keys, put_sizes, put_options(config),
                                         sums if any(c is not None for c in sums) else None,
                                         None if groups is None else [groups[i] for i in idx],
                                         upsert)
        for pos, i in enumerate(idx):
            out[i].code = got[pos]
            if not got[pos]:
                out[i].replicas = list(replicas[pos])
                out[i].caps = caps
        return out

    def write_ranges(self, writes: Sequence[RangeWrite],
                     timeout_s: float | None = None) -> list[tuple[bool, str]]:
        """Copy each write's bytes into its range of every replica: one
        transfer batch, no master call (see Client.write_ranges)."""
        self.session.check()
        results: list[tuple[bool, str]] = [(True, "")] * len(writes)
        todo: list[int] = []
        for w, wr in enumerate(writes):
            n = wr.nbytes()
            bad = next((r for r in wr.replicas
                        if wr.offset < 0 or n < 0 or wr.offset + n > r.length), None)
            if bad is not None:
                results[w] = (False, f"range [{wr.offset}, {wr.offset + n}) is outside "
                                     f"the {bad.length}-byte object")
            elif n:
                todo.append(w)
        if not todo:
            return results
        errors: dict[int, str] = {}
        wrote = self._write(todo, [w.buffer for w in writes], [w.nbytes() for w in writes],
                            [w.replicas for w in writes], [w.caps for w in writes],
                            [w.offset for w in writes], errors, timeout_s)
        for w, c in zip(todo, wrote, strict=True):
            if c:
                results[w] = (False, errors.get(w, c.name))
        return results

    def end_granted(self, keys: Sequence[str]) -> list[ErrorCode]:
        """Make granted keys readable (BATCH_PUT_END); per key OK or why not."""
        self.session.check()
        if not keys:
            return []
        end = self.session.call(BatchPutEnd(self.client_id, list(keys)))
        return [code_of(c) for c in end.codes]

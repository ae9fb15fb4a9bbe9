"""The verifier's cache of verified tokens: a cached token is checked as fully
as a fresh one (range, op, expiry, epoch, segment), the exact-offset fast
path never widens a grant, and the cache stays bounded with O(1) eviction."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.capability import (
    MAX_RANGES,
    CapabilityError,
    CapabilitySigner,
    CapabilityVerifier,
    CapOp,
    DenyReason,
    wall_clock_ms,
)
from kvpool.core.errors import ErrorCode

SEG = "node1:40001"


def _refused(v: CapabilityVerifier, tok: bytes, seg: str, off: int, n: int,
             op: CapOp = CapOp.WRITE) -> DenyReason:
    with pytest.raises(CapabilityError) as ei:
        v.check(tok, seg, off, n, op)
    return ei.value.reason


def _pair(leeway_ms: int = 0, cache_size: int = 1024) -> tuple[CapabilitySigner,
                                                                CapabilityVerifier]:
    signer = CapabilitySigner(ttl_ms=10_000)
    v = CapabilityVerifier(leeway_ms=leeway_ms, cache_size=cache_size)
    v.set_key(SEG, signer.key_for(SEG))
    return signer, v


def test_exact_offset_fast_path_never_widens_a_grant() -> None:
    signer, v = _pair()
    # a repeated offset with two lengths (the shorter last), adjacent ranges, one far range
    flat = [0, 4096, 0, 100, 4096, 4096, 1 << 20, 10]
    tok = signer.grant_ranges(SEG, flat, int(CapOp.WRITE), signer.expiry())
    for off, n in [(0, 4096), (0, 100), (0, 0), (4096, 4096), (1 << 20, 10), (1 << 20, 3),
                   (17, 4000), (4096 + 1, 4095)]:  # exact, shorter and inner ranges pass
        v.check(tok, SEG, off, n, CapOp.WRITE)
    assert v.macs == 1
    for off, n in [(0, 4097),  # longer than the longest grant at that offset
                   (0, 8192),  # two adjacent grants are not one
                   (4096, -1), (0, -1),  # negative lengths
                   (4095, 2), ((1 << 20) + 10, 1), (1 << 20, 11), (1 << 30, 1)]:
        assert _refused(v, tok, SEG, off, n) is DenyReason.OUT_OF_RANGE, (off, n)
    assert v.macs == 1 and v.refusals[DenyReason.OUT_OF_RANGE] == 8


@settings(max_examples=150, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 1 << 12)),
                      min_size=1, max_size=MAX_RANGES),
       queries=st.lists(st.tuples(st.integers(0, (1 << 16) + (1 << 12)),
                                  st.integers(-2, 1 << 13)), min_size=1, max_size=8))
def test_cached_check_matches_containment(spans: list[tuple[int, int]],
                                          queries: list[tuple[int, int]]) -> None:
    """Each query (the first verifies the MAC, the rest hit the cache) is
    allowed iff one granted range contains it."""
    signer, v = _pair()
    flat = [x for s in spans for x in s]
    tok = signer.grant_ranges(SEG, flat, int(CapOp.READ), signer.expiry())
    # some queries land exactly on granted offsets (the fast path)
    queries = queries + [(o, n) for o, n in spans[:4]] + [(o, n + 1) for o, n in spans[:4]]
    for q_off, q_len in queries:
        inside = q_len >= 0 and any(o <= q_off and q_off + q_len <= o + n for o, n in spans)
        if inside:
            v.check(tok, SEG, q_off, q_len, CapOp.READ)
        else:
            assert _refused(v, tok, SEG, q_off, q_len, CapOp.READ) is DenyReason.OUT_OF_RANGE
    assert v.macs == 1


def test_cached_token_refused_when_stale_expired_or_elsewhere() -> None:
    signer, v = _pair()
    signer.epoch = 5
    tok = signer.grant_ranges(SEG, [0, 4096], int(CapOp.WRITE), signer.expiry())
    v.check(tok, SEG, 0, 4096, CapOp.WRITE)  # verified and cached
    # another segment, even one whose key this verifier holds
    v.set_key("other", signer.key_for("other"))
    assert _refused(v, tok, "other", 0, 4096) is DenyReason.WRONG_SEGMENT
    assert _refused(v, tok, "unknown", 0, 4096) is DenyReason.NO_KEY
    assert _refused(v, tok, SEG, 0, 4096, CapOp.READ) is DenyReason.WRONG_OP
    v.check(tok, SEG, 0, 4096, CapOp.WRITE)  # still good after those refusals
    # a newer leader term: the cached token is stale now
    assert v.observe_epoch(6)
    with pytest.raises(CapabilityError) as ei:
        v.check(tok, SEG, 0, 4096, CapOp.WRITE)
    assert ei.value.reason is DenyReason.STALE_EPOCH and ei.value.code == ErrorCode.STALE_EPOCH
    # expiry: a cached token stops working once its expiry (plus leeway) passes
    signer.epoch = 6
    short = signer.grant_ranges(SEG, [0, 4096], int(CapOp.WRITE), wall_clock_ms() + 40)
    v.check(short, SEG, 0, 4096, CapOp.WRITE)
    macs = v.macs
    time.sleep(0.1)
    assert _refused(v, short, SEG, 0, 4096) is DenyReason.EXPIRED
    assert v.macs == macs  # refused from the cache, by its expiry


def test_cache_is_bounded_and_evicts_the_oldest() -> None:
    signer, v = _pair(cache_size=8)
    toks = [signer.grant_ranges(SEG, [i * 4096, 4096], int(CapOp.READ), signer.expiry())
            for i in range(20)]
    for i, tok in enumerate(toks):
        v.check(tok, SEG, i * 4096, 4096, CapOp.READ)
    assert v.macs == 20
    cache = v._verified[SEG]
    assert len(cache) == 8 and list(cache) == toks[-8:]  # the newest 8, oldest first
    for i in range(12, 20):  # cached: no MAC
        v.check(toks[i], SEG, i * 4096, 4096, CapOp.READ)
    assert v.macs == 20
    v.check(toks[0], SEG, 0, 4096, CapOp.READ)  # evicted: verified again, still valid
    assert v.macs == 21 and len(cache) == 8
    # a forged copy of a cached token is not served from the cache (other bytes)
    bad = bytearray(toks[19])
    bad[-1] ^= 1
    assert _refused(v, bytes(bad), SEG, 19 * 4096, 4096, CapOp.READ) is DenyReason.FORGED
    # a new key for the segment drops every cached token
    v.set_key(SEG, signer.rotate(SEG))
    assert len(v._verified[SEG]) == 0
    assert _refused(v, toks[19], SEG, 19 * 4096, 4096, CapOp.READ) is DenyReason.FORGED


def test_check_many_allows_granted_ranges_only_and_counts_no_refusal() -> None:
    """The batch check: True only when every range is a granted one under an
    authentic, current token of the right op; any doubt answers False (the
    caller then checks range by range) and counts nothing."""
    signer, v = _pair()
    flat = [x for off in range(0, 32 * 4096, 4096) for x in (off, 4096)]
    tok = signer.grant_ranges(SEG, flat, int(CapOp.WRITE), signer.expiry())
    offs, lens = flat[::2], flat[1::2]
    assert v.check_many(tok, SEG, offs, lens, CapOp.WRITE)
    assert v.macs == 1 and v.accepted == 32
    assert v.check_many(tok, SEG, offs[:3], [4096, 100, 0], CapOp.WRITE)  # shorter: inside
    assert v.macs == 1  # the cached grant
    refused_before = dict(v.refusals)
    for t, seg, o, n, op in [
        (tok, SEG, offs, [*lens[:-1], 4097], CapOp.WRITE),  # one range longer than granted
        (tok, SEG, [*offs[:-1], 17], lens, CapOp.WRITE),  # an inner range: per-range path
        (tok, SEG, offs, [*lens[:-1], -1], CapOp.WRITE),  # a negative length
        (tok, SEG, offs, lens, CapOp.READ),  # wrong op
        (tok, "other:1", offs, lens, CapOp.WRITE),  # no key for that segment
        (tok[:-1] + bytes([tok[-1] ^ 1]), SEG, offs, lens, CapOp.WRITE),  # forged
        (b"", SEG, offs, lens, CapOp.WRITE),  # none
    ]:
        assert not v.check_many(t, seg, o, n, op)
    assert v.refusals == refused_before and v.accepted == 35
    # the inner range passes the per-range check the caller falls back to
    v.check(tok, SEG, 17, 4000, CapOp.WRITE)
    expired = signer.grant_ranges(SEG, flat, int(CapOp.WRITE), wall_clock_ms() - 10)
    assert not v.check_many(expired, SEG, offs, lens, CapOp.WRITE)
    assert _refused(v, expired, SEG, offs[0], lens[0]) is DenyReason.EXPIRED
    # a token of an older epoch than seen: stale for the batch check too
    v.observe_epoch(5)
    assert not v.check_many(tok, SEG, offs, lens, CapOp.WRITE)
    signer.epoch = 5
    fresh = signer.grant_ranges(SEG, flat, int(CapOp.WRITE), signer.expiry())
    assert v.check_many(fresh, SEG, offs, lens, CapOp.WRITE)

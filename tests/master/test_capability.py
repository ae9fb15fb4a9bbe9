"""Capabilities: forged, expired, widened, other-segment, wrong-op, garbage tokens refused;
one token covers exactly the ranges of a batch, and a verifier checks a token's MAC once."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.capability import (
    MAX_RANGES,
    TAG_LENGTH,
    TOKEN_VERSION,
    CapabilityError,
    CapabilitySigner,
    CapabilityVerifier,
    CapOp,
    DenyReason,
    decode,
    new_segment_key,
    refusal_metrics,
    sign,
    verify,
    wall_clock_ms,
)
from kvpool.core.capability import Capability as Cap
from kvpool.core.errors import ErrorCode, KVPoolError

SEG = "node1:40001"
NOW = 1_800_000_000_000
HDR = struct.Struct(">BBHIQQQ")  # version, op, seg id length, ranges, expiry, nonce, epoch


def _token(key: bytes, seg: str = SEG, off: int = 4096, length: int = 1024,
           op: CapOp = CapOp.READ, expiry: int = NOW + 10_000) -> bytes:
    return sign(Cap.single(seg, off, length, op, expiry), key)


def _denied(reason: DenyReason, *args: object, **kw: object) -> CapabilityError:
    with pytest.raises(CapabilityError) as ei:
        verify(*args, **kw)  # type: ignore[arg-type]
    assert ei.value.code == ErrorCode.PERMISSION_DENIED
    assert isinstance(ei.value, KVPoolError)
    assert ei.value.reason == reason, str(ei.value)
    return ei.value


def test_valid_token_allows_exact_and_inner_ranges() -> None:
    key = new_segment_key()
    tok = _token(key)
    cap = verify(tok, key, SEG, 4096, 1024, CapOp.READ, now_ms=NOW)
    assert (cap.segment_id, cap.ranges, cap.op) == (SEG, ((4096, 1024),), CapOp.READ)
    verify(tok, key, SEG, 4096 + 100, 500, CapOp.READ, now_ms=NOW)
    verify(tok, key, SEG, 4096 + 1024, 0, CapOp.READ, now_ms=NOW)  # empty range at the end
    # ops given as other enums / names / ints are accepted
    verify(tok, key, SEG, 4096, 1, "read", now_ms=NOW)
    verify(tok, key, SEG, 4096, 1, 1, now_ms=NOW)


def test_forged_tokens_are_refused() -> None:
    key = new_segment_key()
    tok = _token(key)
    # signed with another key
    _denied(DenyReason.FORGED, _token(new_segment_key()), key, SEG, 4096, 1024, CapOp.READ,
            now_ms=NOW)
    # every single bit flip of the body or tag is caught (segment id bytes excepted: they
    # change the segment and are reported as such)
    seg_start = HDR.size
    for i in range(len(tok)):
        if 0 <= i < 4 or seg_start <= i < seg_start + len(SEG):
            continue  # version/op/len -> malformed or wrong op; segment id -> wrong segment
        bad = bytearray(tok)
        bad[i] ^= 0x01
        with pytest.raises(CapabilityError) as ei:
            verify(bytes(bad), key, SEG, 4096, 1, CapOp.READ, now_ms=NOW)
        assert ei.value.reason in (DenyReason.FORGED, DenyReason.MALFORMED), i


def test_widened_token_is_refused() -> None:
    key = new_segment_key()
    tok = _token(key, off=4096, length=1024)
    # asking for more than granted with an authentic token
    _denied(DenyReason.OUT_OF_RANGE, tok, key, SEG, 4096, 1025, CapOp.READ, now_ms=NOW)
    _denied(DenyReason.OUT_OF_RANGE, tok, key, SEG, 4095, 10, CapOp.READ, now_ms=NOW)
    _denied(DenyReason.OUT_OF_RANGE, tok, key, SEG, 0, 1 << 40, CapOp.READ, now_ms=NOW)
    _denied(DenyReason.OUT_OF_RANGE, tok, key, SEG, 4096, -1, CapOp.READ, now_ms=NOW)
    # rewriting the granted length inside the token breaks the tag
    at = HDR.size + len(SEG) + 8  # the first range's length
    widened = tok[:at] + (1 << 30).to_bytes(8, "big") + tok[at + 8:]
    _denied(DenyReason.FORGED, widened, key, SEG, 4096, 1 << 20, CapOp.READ, now_ms=NOW)


def test_expired_token_is_refused() -> None:
    key = new_segment_key()
    tok = _token(key, expiry=NOW)
    verify(tok, key, SEG, 4096, 1, CapOp.READ, now_ms=NOW)  # last valid millisecond
    err = _denied(DenyReason.EXPIRED, tok, key, SEG, 4096, 1, CapOp.READ, now_ms=NOW + 1)
    assert "expired" in str(err)
    verify(tok, key, SEG, 4096, 1, CapOp.READ, now_ms=NOW + 500, leeway_ms=500)
    # the default clock is wall-clock epoch ms
    old = _token(key, expiry=wall_clock_ms() - 1000)
    _denied(DenyReason.EXPIRED, old, key, SEG, 4096, 1, CapOp.READ)


def test_replay_for_another_segment_is_refused() -> None:
    key_a, key_b = new_segment_key(), new_segment_key()
    tok_a = _token(key_a, seg="A")
    # presented against segment B (whose owner holds key_b)
    _denied(DenyReason.WRONG_SEGMENT, tok_a, key_b, "B", 4096, 1, CapOp.READ, now_ms=NOW)
    # rewriting the segment id inside the token to B breaks the tag under B's key
    rewritten = tok_a[:HDR.size] + b"B" + tok_a[HDR.size + 1:]
    _denied(DenyReason.FORGED, rewritten, key_b, "B", 4096, 1, CapOp.READ, now_ms=NOW)


def test_wrong_op_is_refused_both_ways() -> None:
    key = new_segment_key()
    _denied(DenyReason.WRONG_OP, _token(key, op=CapOp.READ), key, SEG, 4096, 1, CapOp.WRITE,
            now_ms=NOW)
    _denied(DenyReason.WRONG_OP, _token(key, op=CapOp.WRITE), key, SEG, 4096, 1, CapOp.READ,
            now_ms=NOW)
    verify(_token(key, op=CapOp.WRITE), key, SEG, 4096, 1, CapOp.WRITE, now_ms=NOW)


def test_truncated_and_garbage_tokens_are_malformed() -> None:
    key = new_segment_key()
    tok = _token(key)
    _denied(DenyReason.MISSING, b"", key, SEG, 0, 1, CapOp.READ)
    for n in (1, 10, len(tok) - TAG_LENGTH, len(tok) - 1):
        _denied(DenyReason.MALFORMED, tok[:n], key, SEG, 4096, 1, CapOp.READ, now_ms=NOW)
    _denied(DenyReason.MALFORMED, tok + b"x", key, SEG, 4096, 1, CapOp.READ, now_ms=NOW)
    _denied(DenyReason.MALFORMED, bytes([TOKEN_VERSION ^ 3]) + tok[1:], key, SEG, 4096, 1,
            CapOp.READ, now_ms=NOW)
    _denied(DenyReason.MALFORMED, tok[:1] + b"\x07" + tok[2:], key, SEG, 4096, 1, CapOp.READ,
            now_ms=NOW)
    _denied(DenyReason.MALFORMED, "a string", key, SEG, 4096, 1, CapOp.READ, now_ms=NOW)
    _denied(DenyReason.MALFORMED, 12345, key, SEG, 4096, 1, CapOp.READ, now_ms=NOW)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_verify(data: bytes) -> None:
    key = new_segment_key()
    with pytest.raises(CapabilityError) as ei:
        verify(data, key, SEG, 0, 1, CapOp.READ, now_ms=NOW)
    assert ei.value.code == ErrorCode.PERMISSION_DENIED


@settings(max_examples=200, deadline=None)
@given(off=st.integers(0, 1 << 40), length=st.integers(0, 1 << 30),
       q_off=st.integers(0, 1 << 41), q_len=st.integers(0, 1 << 31))
def test_range_rule_matches_containment(off: int, length: int, q_off: int, q_len: int) -> None:
    key = new_segment_key()
    tok = _token(key, off=off, length=length)
    inside = off <= q_off and q_off + q_len <= off + length
    if inside:
        verify(tok, key, SEG, q_off, q_len, CapOp.READ, now_ms=NOW)
    else:
        _denied(DenyReason.OUT_OF_RANGE, tok, key, SEG, q_off, q_len, CapOp.READ, now_ms=NOW)


def test_decode_roundtrip_and_sign_validation() -> None:
    key = new_segment_key()
    cap = Cap("seg-é", ((1, 2), (10, 5)), CapOp.WRITE, 3, nonce=12345678)
    tok = sign(cap, key)
    assert decode(tok) == cap
    assert sign(cap, key) == tok  # deterministic for a given nonce
    assert _token(key) != _token(key)  # random nonce otherwise
    for bad in (Cap.single("", 0, 1, CapOp.READ, 1), Cap.single(SEG, -1, 1, CapOp.READ, 1),
                Cap.single(SEG, 0, 1 << 64, CapOp.READ, 1),
                Cap.single(SEG, 0, 1, CapOp.READ, 1, 1 << 64), Cap(SEG, (), CapOp.READ, 1),
                Cap(SEG, ((0, 1),) * (MAX_RANGES + 1), CapOp.READ, 1)):
        with pytest.raises(KVPoolError) as ei:
            sign(bad, key)
        assert ei.value.code == ErrorCode.INVALID_PARAMS
    with pytest.raises(KVPoolError):
        sign(Cap.single(SEG, 0, 1, CapOp.READ, 1), b"")
    with pytest.raises(KVPoolError):
        CapOp.coerce("delete")


def test_signer_and_verifier_count_refusals() -> None:
    signer = CapabilitySigner(ttl_ms=5000)
    seen: list[DenyReason] = []
    ver = CapabilityVerifier(on_refusal=seen.append)
    ver.set_key("A", signer.key_for("A"))
    assert signer.key_for("A") == signer.key_for("A")  # stable per segment
    tok = signer.grant("A", 0, 100, CapOp.WRITE)
    ver.check(tok, "A", 10, 90, CapOp.WRITE)
    for args, reason in [
        ((tok, "A", 0, 101, CapOp.WRITE), DenyReason.OUT_OF_RANGE),
        ((tok, "A", 0, 1, CapOp.READ), DenyReason.WRONG_OP),
        ((tok, "B", 0, 1, CapOp.WRITE), DenyReason.NO_KEY),
        ((b"", "A", 0, 1, CapOp.WRITE), DenyReason.MISSING),
        ((None, "A", 0, 1, CapOp.WRITE), DenyReason.MISSING),
        ((signer.grant("A", 0, 100, CapOp.WRITE, ttl_ms=-5000), "A", 0, 1, CapOp.WRITE),
         DenyReason.EXPIRED),
    ]:
        with pytest.raises(CapabilityError) as ei:
            ver.check(*args)
        assert ei.value.reason == reason
    assert ver.refused_total == 6 and len(seen) == 6
    assert ver.refusals[DenyReason.MISSING] == 2
    # a master restart keeps the keys when it persisted them
    restored = CapabilitySigner()
    restored.load_keys(signer.keys())
    ver.check(restored.grant("A", 0, 1, CapOp.READ), "A", 0, 1, CapOp.READ)
    signer.forget("A")
    assert signer.key_for("A") != restored.key_for("A")
    # optional mode lets token-less requests through but still checks presented tokens
    lax = CapabilityVerifier(required=False)
    lax.check(b"", "A", 0, 1, CapOp.READ)
    with pytest.raises(CapabilityError):
        lax.check(tok, "A", 0, 1, CapOp.WRITE)
    ver.remove_key("A")
    with pytest.raises(CapabilityError):
        ver.check(tok, "A", 0, 1, CapOp.WRITE)



def test_refusals_are_exported_as_prometheus_counters() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    ver = CapabilityVerifier()
    key = new_segment_key()
    ver.set_key(SEG, key)

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            yield from refusal_metrics(ver)

    reg = CollectorRegistry()
    reg.register(Collector())  # type: ignore[arg-type]
    good = sign(Cap.single(SEG, 0, 10, CapOp.READ, wall_clock_ms() + 60_000), key)
    ver.check(good, SEG, 0, 10, CapOp.READ)
    for _ in range(3):
        with pytest.raises(CapabilityError):
            ver.check(good, SEG, 0, 11, CapOp.READ)
    with pytest.raises(CapabilityError):
        ver.check(_token(new_segment_key()), SEG, 4096, 1, CapOp.READ)
    text = generate_latest(reg).decode()
    assert 'kvpool_capability_refusals_total{reason="out_of_range"} 3.0' in text
    assert 'kvpool_capability_refusals_total{reason="forged"} 1.0' in text
    assert "kvpool_capability_accepted_total 1.0" in text


def test_grant_fast_verifies_and_rotation_invalidates() -> None:
    signer = CapabilitySigner(ttl_ms=5000)
    assert signer.grant_fast(SEG, 0, 10, int(CapOp.READ), signer.expiry()) == b""  # no key yet
    key = signer.key_for(SEG)
    tok = signer.grant_fast(SEG, 4096, 1024, int(CapOp.WRITE), signer.expiry())
    assert verify(tok, key, SEG, 4096, 1024, CapOp.WRITE).ranges == ((4096, 1024),)
    other = signer.grant_fast(SEG, 4096, 1024, int(CapOp.WRITE), signer.expiry())
    assert other != tok  # distinct nonces
    new_key = signer.rotate(SEG)
    assert new_key != key
    _denied(DenyReason.FORGED, tok, new_key, SEG, 4096, 1024, CapOp.WRITE)
    signer.forget(SEG)
    assert not signer.has_key(SEG)


def test_batch_token_covers_exactly_its_ranges() -> None:
    key = new_segment_key()
    # three replicas of one batch, two of them adjacent, one far; unsorted on purpose
    ranges = ((8192, 100), (0, 4096), (4096, 4096))
    tok = sign(Cap(SEG, ranges, CapOp.WRITE, NOW + 10_000), key)
    for off, n in ranges:
        verify(tok, key, SEG, off, n, CapOp.WRITE, now_ms=NOW)
        verify(tok, key, SEG, off + 1, n - 1, CapOp.WRITE, now_ms=NOW)  # inside one range
    for off, n in [(4096 - 1, 2),  # straddles two granted ranges: each grant is one object
                   (8192 + 100, 1), (9000, 1), (0, 8192 + 100), (1 << 30, 1), (8192, 101)]:
        _denied(DenyReason.OUT_OF_RANGE, tok, key, SEG, off, n, CapOp.WRITE, now_ms=NOW)


@settings(max_examples=100, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 12)),
                      min_size=1, max_size=MAX_RANGES),
       q_off=st.integers(0, (1 << 20) + (1 << 12)), q_len=st.integers(0, 1 << 13))
def test_batch_range_rule_matches_containment(spans: list[tuple[int, int]], q_off: int,
                                              q_len: int) -> None:
    key = new_segment_key()
    tok = sign(Cap(SEG, tuple(spans), CapOp.READ, NOW + 10), key)
    inside = any(o <= q_off and q_off + q_len <= o + n for o, n in spans)
    if inside:
        verify(tok, key, SEG, q_off, q_len, CapOp.READ, now_ms=NOW)
    else:
        _denied(DenyReason.OUT_OF_RANGE, tok, key, SEG, q_off, q_len, CapOp.READ, now_ms=NOW)


def test_signer_grant_ranges_and_verifier_checks_each_token_once() -> None:
    signer = CapabilitySigner(ttl_ms=5000)
    ver = CapabilityVerifier()
    ver.set_key("A", signer.key_for("A"))
    flat = [v for i in range(MAX_RANGES) for v in (i * 8192, 4096)]
    tok = signer.grant_ranges("A", flat, int(CapOp.READ), signer.expiry())
    assert signer.granted == 1 and signer.granted_ranges == MAX_RANGES
    for i in range(MAX_RANGES):
        ver.check(tok, "A", i * 8192, 4096, CapOp.READ)
    assert ver.macs == 1 and ver.accepted == MAX_RANGES  # one MAC for the whole batch
    # a cached token is still checked in full: range, op, other segment
    with pytest.raises(CapabilityError) as ei:
        ver.check(tok, "A", 4096, 1, CapOp.READ)
    assert ei.value.reason == DenyReason.OUT_OF_RANGE
    with pytest.raises(CapabilityError) as ei:
        ver.check(tok, "A", 0, 1, CapOp.WRITE)
    assert ei.value.reason == DenyReason.WRONG_OP
    ver.set_key("B", signer.key_for("B"))
    with pytest.raises(CapabilityError) as ei:
        ver.check(tok, "B", 0, 1, CapOp.READ)
    assert ei.value.reason == DenyReason.WRONG_SEGMENT
    # a tampered copy of a cached token is not served from the cache
    bad = bytearray(tok)
    bad[-1] ^= 1
    with pytest.raises(CapabilityError) as ei:
        ver.check(bytes(bad), "A", 0, 1, CapOp.READ)
    assert ei.value.reason == DenyReason.FORGED
    # a new key (re-mount) forgets every token verified under the old one
    ver.set_key("A", signer.rotate("A"))
    with pytest.raises(CapabilityError) as ei:
        ver.check(tok, "A", 0, 1, CapOp.READ)
    assert ei.value.reason == DenyReason.FORGED
    # an expired token is refused even when it was verified before
    short = signer.grant_ranges("A", [0, 10], int(CapOp.READ), wall_clock_ms() + 50)
    lax = CapabilityVerifier(leeway_ms=0)
    lax.set_key("A", signer.key_for("A"))
    lax.check(short, "A", 0, 10, CapOp.READ)
    import time

    time.sleep(0.1)
    with pytest.raises(CapabilityError) as ei:
        lax.check(short, "A", 0, 10, CapOp.READ)
    assert ei.value.reason == DenyReason.EXPIRED

"""Capability epochs (HA fencing): tokens carry the signing leader's term; a
verifier refuses tokens of a term older than the newest it has seen (from
authentic tokens or the master's ping replies) and keeps accepting the same
and newer terms; epoch 0 (a master without HA) works exactly as before."""

from __future__ import annotations

import pytest

from kvpool.core.capability import (
    Capability,
    CapabilityError,
    CapabilitySigner,
    CapabilityVerifier,
    CapOp,
    DenyReason,
    decode,
    new_segment_key,
    sign,
    verify,
    wall_clock_ms,
)
from kvpool.core.errors import ErrorCode, KVPoolError

SEG = "node1:40001"


def _stale(v: CapabilityVerifier, tok: bytes, off: int = 0, n: int = 64) -> CapabilityError:
    with pytest.raises(CapabilityError) as ei:
        v.check(tok, SEG, off, n, CapOp.READ)
    assert ei.value.reason is DenyReason.STALE_EPOCH, str(ei.value)
    assert ei.value.code == ErrorCode.STALE_EPOCH  # retryable: not PERMISSION_DENIED
    return ei.value


def test_epoch_is_signed_into_the_token() -> None:
    key = new_segment_key()
    exp = wall_clock_ms() + 10_000
    tok = sign(Capability.single(SEG, 0, 64, CapOp.READ, exp, epoch=41), key)
    assert decode(tok).epoch == 41
    # the epoch is covered by the tag: rewriting it breaks the signature
    at = 1 + 1 + 2 + 4 + 8 + 8  # version, op, id length, count, expiry, nonce
    bumped = tok[:at] + (42).to_bytes(8, "big") + tok[at + 8:]
    with pytest.raises(CapabilityError) as ei:
        verify(bumped, key, SEG, 0, 64, CapOp.READ)
    assert ei.value.reason is DenyReason.FORGED
    with pytest.raises(KVPoolError) as bad:
        sign(Capability.single(SEG, 0, 64, CapOp.READ, exp, epoch=-1), key)
    assert bad.value.code == ErrorCode.INVALID_PARAMS
    # the stateless check: below min_epoch is stale, at or above passes
    verify(tok, key, SEG, 0, 64, CapOp.READ, min_epoch=41)
    with pytest.raises(CapabilityError) as ei:
        verify(tok, key, SEG, 0, 64, CapOp.READ, min_epoch=42)
    assert ei.value.reason is DenyReason.STALE_EPOCH


def test_verifier_refuses_older_epochs_after_seeing_a_newer_one() -> None:
    signer = CapabilitySigner(ttl_ms=10_000)
    v = CapabilityVerifier()
    v.set_key(SEG, signer.key_for(SEG))
    exp = signer.expiry()

    def grant(epoch: int) -> bytes:
        signer.epoch = epoch
        return signer.grant_ranges(SEG, (0, 64, 128, 64), int(CapOp.READ), exp)

    t5 = grant(5)
    v.check(t5, SEG, 0, 64, CapOp.READ)
    assert v.epoch == 5  # an authentic token raises the high-water
    t7 = grant(7)
    v.check(t7, SEG, 128, 64, CapOp.READ)
    assert v.epoch == 7
    v.check(t7, SEG, 0, 32, CapOp.READ)  # same epoch: accepted (from the cache)
    assert v.macs == 2
    _stale(v, t5)  # verified and cached before the epoch rose: refused now
    _stale(v, grant(5))  # a fresh token of the old term: refused, never cached
    v.check(grant(9), SEG, 0, 64, CapOp.READ)  # newer: accepted
    assert v.epoch == 9
    _stale(v, t7)
    # the master's ping reply raises it with no token at all
    t9 = grant(9)
    v.check(t9, SEG, 0, 64, CapOp.READ)
    assert v.observe_epoch(12) and v.epoch == 12
    assert not v.observe_epoch(3) and v.epoch == 12  # never lowered
    _stale(v, t9)
    v.check(grant(12), SEG, 0, 64, CapOp.READ)
    assert v.refusals[DenyReason.STALE_EPOCH] == 4
    # a forged token claiming a far newer epoch does not move the high-water
    forged = sign(Capability.single(SEG, 0, 64, CapOp.READ, exp, epoch=1 << 40),
                  new_segment_key())
    with pytest.raises(CapabilityError) as ei:
        v.check(forged, SEG, 0, 64, CapOp.READ)
    assert ei.value.reason is DenyReason.FORGED and v.epoch == 12


def test_epoch_zero_single_master_tokens_keep_working() -> None:
    signer = CapabilitySigner(ttl_ms=10_000)  # no HA: epoch 0
    v = CapabilityVerifier()
    v.set_key(SEG, signer.key_for(SEG))
    exp = signer.expiry()
    toks = [signer.grant_ranges(SEG, (i * 64, 64), int(CapOp.WRITE), exp) for i in range(20)]
    for i, tok in enumerate(toks):
        assert decode(tok).epoch == 0
        for _ in range(3):
            v.check(tok, SEG, i * 64, 64, CapOp.WRITE)
    assert not v.observe_epoch(0)  # a single master's ping reply (epoch 0) changes nothing
    v.check(signer.grant(SEG, 0, 64, CapOp.READ), SEG, 0, 64, CapOp.READ)
    assert v.epoch == 0 and v.refused_total == 0
    assert v.macs == 21 and v.accepted == 61  # one MAC per token, the rest cached
    assert signer.granted == 20  # one signature per grant_ranges call

"""The store client's side of capability fencing, with a real master and a
real segment-owning client: a READ/WRITE refused as STALE_EPOCH (the grant is
of an older master term than the owner has seen) makes the client ask the
master once more, then fail with the typed, retryable StaleEpoch; epoch 0
(a master without HA) keeps working as before."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.capability import DenyReason, decode
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import Exist, GetReplicaList
from kvpool.store import Client, ReplicateConfig
from kvpool.store.client import RangeRead
from kvpool.store.errors import StaleEpoch, StoreError, error_for_code
from kvpool.transfer.types import TransferError


def _stale_refusals(owner: Client) -> int:
    return int(owner.engine.capability_stats()["capability_refusals"][
        DenyReason.STALE_EPOCH.value])


def test_stale_grants_are_reasked_then_typed(master: MasterProcess,
                                             make_client: Callable[..., Client],
                                             key: Callable[[str], str]) -> None:
    # separate hosts: every byte goes over tcp through the owner's capability check
    owner = make_client(memory_size=8 << 20, host_id="owner-host")
    reader = make_client(host_id="reader-host", checksum="crc32")
    seg = owner.segment_ids[0]
    cfg = ReplicateConfig(preferred_segments=[seg])
    k = key("v")
    value = bytes(range(256)) * 32
    reader.put(k, value, cfg)
    # single master: epoch-0 tokens, and the owner's high-water stays 0
    with master.client() as mc:
        g = mc.call(GetReplicaList(key=k))
    assert decode(g.caps[g.replicas[0].cap]).epoch == 0
    assert reader.get(k) == value
    assert owner.engine.capabilities.epoch == 0
    assert _stale_refusals(owner) == 0

    # the owner hears of a newer term than this master signs in (as after a failover
    # to a leader the reader's master link has not found yet)
    owner.engine.observe_master_epoch(7)
    assert owner.engine.capabilities.epoch == 7
    with pytest.raises(StaleEpoch) as ei:
        reader.get(k)
    assert ei.value.code == ErrorCode.STALE_EPOCH
    assert _stale_refusals(owner) == 2  # refused, asked the master again, refused again
    assert reader.batch_get_into([k], [bytearray(len(value))]) == [int(ErrorCode.STALE_EPOCH)]
    assert _stale_refusals(owner) == 4
    assert reader.get_batch([k]) == [None]
    # read_ranges makes no RPC: it reports the code so the caller locates again
    (loc,) = reader.batch_locate([k])
    buf = bytearray(64)
    assert reader.read_ranges([RangeRead(loc, buf, 16, 64)]) == [int(ErrorCode.STALE_EPOCH)]
    with pytest.raises(StaleEpoch):
        reader.put(key("w"), b"x" * 1000, cfg)
    with master.client() as mc:
        assert not mc.call(Exist(key=key("w"))).exists  # both attempts were revoked
    # the owner's segment was not written off: a term it accepts works at once
    owner.engine.capabilities.epoch = 0  # (test only: a fresh daemon of this master)
    assert reader.get(k) == value
    assert isinstance(error_for_code(ErrorCode.STALE_EPOCH), StaleEpoch)
    assert issubclass(StaleEpoch, StoreError)
    assert not issubclass(StaleEpoch, TransferError)

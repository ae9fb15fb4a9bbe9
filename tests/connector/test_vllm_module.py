"""The vLLM entry module: version gate and stats class (needs vLLM importable)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm not importable: install the vllm extra"),
]


def test_version_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.connector.vllm import check_vllm_version

    monkeypatch.delenv("KVPOOL_SKIP_VLLM_VERSION_CHECK", raising=False)
    for good in ("0.31.0", "0.32.0", "0.32.3+cpu", "0.33.1"):
        check_vllm_version(good)
    for bad in ("0.30.2", "0.34.0", "1.0.0", "unknown"):
        with pytest.raises(ImportError, match=r"supports vLLM 0\.31\.x, 0\.32\.x, 0\.33\.x"):
            check_vllm_version(bad)
    monkeypatch.setenv("KVPOOL_SKIP_VLLM_VERSION_CHECK", "1")
    check_vllm_version("0.30.2")


def test_stats_class_aggregates_over_workers() -> None:
    from kvpool.connector.vllm import KVPoolConnector, KVPoolConnectorStats

    a = KVPoolConnector.build_kv_connector_stats({"loaded_bytes": 10, "load_requests": 1,
                                                   "load_time_s": 0.5})
    assert isinstance(a, KVPoolConnectorStats)
    a.aggregate(KVPoolConnectorStats(data={"loaded_bytes": 5, "hit_tokens": 64}))
    assert a.data == {"loaded_bytes": 15, "load_requests": 1, "load_time_s": 0.5,
                      "hit_tokens": 64}
    assert a.reduce()["avg_load_ms"] == pytest.approx(500)
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()


def test_pool_events_become_vllm_kv_events() -> None:
    """kvpool's events in vLLM's classes: what vLLM's publisher sends to routers."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvpool.connector.events import Medium, PoolEvent
    from kvpool.connector.vllm import to_vllm_event

    h = [b"\x01" * 32, b"\x02" * 32]
    st = to_vllm_event(PoolEvent(True, tuple(h), Medium.DRAM, b"\x00" * 32, tuple(range(64))))
    assert isinstance(st, BlockStored)
    # as vLLM publishes its own blocks (ints by default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    conv = [maybe_convert_block_hash(x) for x in h]
    assert (st.block_hashes, st.parent_block_hash, st.block_size, st.medium) == (
        conv, maybe_convert_block_hash(b"\x00" * 32), 32, "KVPOOL_DRAM")
    rm = to_vllm_event(PoolEvent(False, tuple(h), Medium.DISK))
    assert isinstance(rm, BlockRemoved) and rm.medium == "KVPOOL_DISK"
    # the batch round-trips through vLLM's wire encoding (msgspec)
    wire = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[st, rm]))
    back = msgspec.msgpack.decode(wire, type=KVEventBatch)
    assert back.events == [st, rm]

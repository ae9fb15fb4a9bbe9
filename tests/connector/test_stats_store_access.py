"""Connector metrics and the store circuit breaker (recovery after an outage)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.scheduler import KVPoolScheduler
from kvpool.connector.stats import ConnectorStats, merge_stats, reduce_stats
from kvpool.connector.store_access import StoreAccess, StoreUnavailable


def test_interval_counters() -> None:
    s = ConnectorStats()
    s.add(hit_tokens=128, lookup_tokens=200, load_time_s=0.5, load_requests=1,
          loaded_bytes=10**9)
    # nothing in this process's default registry: the series are vLLM's
    # (build_prom_metrics in the API server; tests/connector/test_vllm_metrics.py)
    assert REGISTRY.get_sample_value("kvpool_connector_hit_tokens_total") is None
    first = s.take()
    assert first["hit_tokens"] == 128 and "saved_bytes" not in first  # zeros dropped
    assert s.take() == {}  # reset per interval
    assert s.totals()["hit_tokens"] == 128  # totals kept
    with pytest.raises(KeyError):
        s.add(bogus=1)
    red = reduce_stats(merge_stats(first, {"hit_tokens": 72, "lookup_tokens": 200}))
    assert red["hit_rate"] == pytest.approx(0.5)
    assert red["load_GBps"] == pytest.approx(2.0)
    assert red["avg_load_ms"] == pytest.approx(500)


def test_lookups_recover_when_the_master_comes_back() -> None:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess, find_free_port
    from kvpool.store import Client, ClientConfig

    port = find_free_port()
    cfg = ConnectorConfig(master_address=f"127.0.0.1:{port}", chunk_size=32,
                          rpc_timeout_s=0.3, retry_interval_s=0.5)
    ks = KeySpace("m", "bf16", 16, 32)
    store = StoreAccess(cfg)
    sched = KVPoolScheduler(cfg, ks, 1, store)
    toks = list(range(65))
    assert sched.lookup("a", toks, 0) == (0, False)
    with pytest.raises(StoreUnavailable):
        store.batch_exists(["k"])  # circuit open
    with MasterProcess(port=port) as m, NodeDaemonProcess(m.address, memory="8MiB"):
        with Client(ClientConfig(master_address=m.address)) as c:
            for h in ks.chunk_hashes(toks):
                for k in ks.chunk_keys(h, 1, 4):
                    c.put(k, b"kv")
        time.sleep(0.6)  # retry interval over: the next lookup reconnects
        assert sched.lookup("b", toks, 0) == (64, False)
    store.close()


def test_store_parts_and_locations_the_connector_uses() -> None:
    """Client.batch_get_into_parts (one RPC, then part after part with a
    callback) and Client.batch_replica_locations, against a real pool."""
    import numpy as np

    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.core.errors import ErrorCode
    from kvpool.store import Client, ClientConfig

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="8MiB") as d:
        with Client(ClientConfig(master_address=m.address)) as c:
            vals = {f"k{i}": bytes([i + 1]) * (1000 + i) for i in range(4)}
            for k, v in vals.items():
                c.put(k, v)
            keys = [*vals, "missing"]
            bufs = [np.zeros(2000, dtype=np.uint8) for _ in keys]
            seen: list[tuple[int, list[int]]] = []
            res = c.batch_get_into_parts(keys, bufs, [[0, 1], [3, 4]],
                                         lambda p, r: seen.append((p, list(r))))
            assert seen == [(0, [1000, 1001]), (1, [1003, int(ErrorCode.OBJECT_NOT_FOUND)])]
            assert res[:2] == [1000, 1001] and res[3] == 1003
            for i in (0, 1, 3):
                assert bytes(bufs[i][: 1000 + i]) == vals[f"k{i}"]
            assert not bufs[2].any()  # in no part: not read
            locs = c.batch_replica_locations(keys)
            assert locs[4] is None
            for i in range(4):
                (loc,) = locs[i]
                assert loc.size == 1000 + i and loc.same_host and int(loc.kind) == 0
                assert loc.segment_id in d.segment_ids

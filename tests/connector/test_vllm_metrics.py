"""The connector's counters through vLLM's own stats path, as ``vllm serve`` runs it:
each worker's stats summed by vLLM's KVOutputAggregator, the scheduler's added
as its update_from_output does, the payload sent to the API server in vLLM's
wire encoding, and there handed to vLLM's KVConnectorLogging and
KVConnectorProm, which build the connector's Prometheus series."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm not importable: install the vllm extra"),
]


def test_counters_reach_vllm_prometheus_through_its_aggregation() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from kvpool.connector.stats import ConnectorStats
    from kvpool.connector.vllm import KVPoolConnector

    def connector_stats(stats: ConnectorStats) -> Any:
        # KVPoolConnector.get_kv_connector_stats on a connector holding `stats`
        return KVPoolConnector.get_kv_connector_stats(SimpleNamespace(stats=stats))  # type: ignore[arg-type]

    # what the connector's roles count in one step: two TP workers and the scheduler
    w0, w1, sched = ConnectorStats(), ConnectorStats(), ConnectorStats()
    w0.add(load_requests=1, loaded_chunks=2, loaded_bytes=4096, load_time_s=0.02)
    w0.sample("load_seconds", 0.02)
    w1.add(load_requests=1, loaded_chunks=2, loaded_bytes=4096, load_time_s=0.03,
           saved_chunks=4, saved_bytes=8192, save_time_s=0.5, save_batches=1)
    w1.sample("load_seconds", 0.03)
    w1.sample("save_seconds", 0.5)
    sched.add(lookups=1, lookup_tokens=256, hit_tokens=128)
    assert connector_stats(ConnectorStats()) is None  # an idle interval sends nothing

    # the workers' outputs, aggregated as vLLM's executor does
    outs: list[ModelRunnerOutput | None] = [
        ModelRunnerOutput(req_ids=[], req_id_to_index={},
                          kv_connector_output=KVConnectorOutput(
                              kv_connector_stats=connector_stats(w)))
        for w in (w0, w1)]
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outs)
    assert merged is not None and merged.kv_connector_output is not None
    stats = merged.kv_connector_output.kv_connector_stats
    assert stats is not None
    # ... then the scheduler's own (Scheduler.update_from_output)
    sched_stats = connector_stats(sched)
    assert not sched_stats.is_empty()
    stats = stats.aggregate(sched_stats)
    # the engine core ships SchedulerStats.kv_connector_stats = to_dict() to the API server
    wire = MsgpackEncoder().encode(EngineCoreOutputs(
        scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict())))
    got = MsgpackDecoder(EngineCoreOutputs).decode(wire)
    assert got.scheduler_stats is not None
    payload = got.scheduler_stats.kv_connector_stats
    assert payload is not None

    ktc = KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both",
                           kv_connector_module_path="kvpool.connector.vllm")
    # the logger's line (KVConnectorLogging: build_kv_connector_stats, aggregate, reduce)
    logging_ = KVConnectorLogging(ktc)
    logging_.observe(payload)
    logging_.observe({"hit_tokens": 64, "lookup_tokens": 256})  # the next step
    lines: list[str] = []
    logging_.log(lambda fmt, *a: lines.append(fmt % a))
    assert lines and "hit_tokens=192" in lines[0] and "hit_rate=0.375" in lines[0], lines
    assert "loaded_bytes=8192" in lines[0] and "saved_bytes=8192" in lines[0]

    # the Prometheus series (KVConnectorProm -> build_prom_metrics), bound to a registry
    reg = CollectorRegistry()

    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *a: object, **kw: object) -> None:
                super().__init__(*a, registry=reg, **kw)
        return Bound

    class Prom(KVConnectorProm):
        _gauge_cls = bound(Gauge)
        _counter_cls = bound(Counter)
        _histogram_cls = bound(Histogram)

    prom = Prom(SimpleNamespace(kv_transfer_config=ktc), ["model_name", "engine"],  # type: ignore[arg-type]
                {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(payload, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}

    def value(name: str, **extra: str) -> float | None:
        return reg.get_sample_value(name, {**labels, **extra})

    assert value("kvpool_connector_hit_tokens_total") == 128
    assert value("kvpool_connector_lookup_tokens_total") == 256
    assert value("kvpool_connector_loaded_bytes_total") == 8192
    assert value("kvpool_connector_saved_bytes_total") == 8192
    assert value("kvpool_connector_loaded_chunks_total") == 4
    assert value("kvpool_connector_load_seconds_count") == 2
    assert value("kvpool_connector_load_seconds_sum") == pytest.approx(0.05)
    assert value("kvpool_connector_load_seconds_bucket", le="0.025") == 1
    assert value("kvpool_connector_save_seconds_count") == 1
    assert value("kvpool_connector_save_seconds_sum") == pytest.approx(0.5)
    # per engine: the other engine's series stay at zero
    assert reg.get_sample_value("kvpool_connector_hit_tokens_total",
                                {"model_name": "m", "engine": "1"}) == 0


def test_samples_merge_without_changing_the_payload() -> None:
    """vLLM hands one payload to its logger and its Prometheus logger: merging
    must not change it; sample lists are joined and bounded."""
    from kvpool.connector.stats import MAX_SAMPLES, ConnectorStats, merge_stats
    from kvpool.connector.vllm import KVPoolConnector

    s = ConnectorStats()
    for _ in range(MAX_SAMPLES + 10):
        s.sample("load_seconds", 0.001)
    with pytest.raises(KeyError):
        s.sample("bogus", 1.0)
    data = s.take()
    assert len(data["load_seconds"]) == MAX_SAMPLES and s.take() == {}
    payload = {"hit_tokens": 1, "load_seconds": [0.5]}
    acc = KVPoolConnector.build_kv_connector_stats(payload)
    assert acc is not None
    acc.aggregate(KVPoolConnector.build_kv_connector_stats(payload))  # type: ignore[arg-type]
    assert acc.data == {"hit_tokens": 2, "load_seconds": [0.5, 0.5]}
    assert payload == {"hit_tokens": 1, "load_seconds": [0.5]}
    assert len(merge_stats(data, data)["load_seconds"]) == MAX_SAMPLES
    assert acc.reduce() == {"hit_tokens": 2}  # the log line sums counters only

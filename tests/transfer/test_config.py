"""Selector/transport configuration: defaults and ConfigError on bad input."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvpool.core.config import ConfigError
from kvpool.core.protocol import SegmentKind
from kvpool.transfer import TransferEngine, load_transfer_config
from kvpool.transfer.config import DEFAULT_CONFIG_PATH


def test_shipped_yaml_loads_with_documented_defaults() -> None:
    assert DEFAULT_CONFIG_PATH.exists()
    cfg = load_transfer_config()
    assert cfg.max_failover == 2
    names = {r.name: r.transports for r in cfg.rules}
    assert names["local-memory"][0] == "shm"
    assert names["remote-memory"] == ["rdma", "tcp"]
    assert "posix" in names["local-file"] and "gds" in names["local-file-gpu"]
    assert cfg.transports["tcp"].chunk_bytes == 4 << 20
    assert cfg.server.max_request_bytes == 64 << 20
    # tcp streams: half the CPUs this process may use, from 2 to 8 (the YAML says auto too)
    want = max(2, min(8, len(os.sched_getaffinity(0)) // 2))
    assert cfg.transports["tcp"].threads == want
    assert load_transfer_config(DEFAULT_CONFIG_PATH).transports["tcp"].threads == want
    assert load_transfer_config(overrides={"transports": {"tcp": {"threads": 3}}}) \
        .transports["tcp"].threads == 3


def test_rule_matching_order() -> None:
    cfg = load_transfer_config()
    first = next(r for r in cfg.rules if r.matches(SegmentKind.MEMORY, False, "cpu", 10))
    assert first.name == "remote-memory"
    first = next(r for r in cfg.rules if r.matches(SegmentKind.FILE, True, "cuda", 10))
    assert first.name == "local-file-gpu"


@pytest.mark.parametrize("overrides, needle", [
    ({"bogus": 1}, "bogus"),
    ({"transports": {"tcp": {"nope": 1}}}, "nope"),
    ({"transports": {"warp": {}}}, "warp"),
    ({"rules": [{"transports": ["warp"]}]}, "warp"),
    ({"rules": [{"transports": []}]}, "empty transport list"),
    ({"rules": [{"transports": ["tcp"], "min_size": "2MiB", "max_size": "1MiB"}]}, "min_size"),
    ({"rules": [{"transports": ["tcp"], "kind": "tape"}]}, "kind"),
    ({"rules": [{"transports": ["tcp"], "device": "tpu"}]}, "device"),
    ({"rules": [{"transports": ["tcp"], "same_host": "maybe"}]}, "same_host"),
    ({"rules": [{"transports": ["tcp", "tcp"]}]}, "duplicate"),
    ({"rules": []}, "no selector rules"),
    ({"max_failover": -1}, "max_failover"),
    ({"transports": {"tcp": {"enabled": "sometimes"}}}, "enabled"),
    ({"transports": {"tcp": {"threads": 0}}}, "threads"),
    ({"transports": {"tcp": {"threads": "many"}}}, "threads"),
    ({"transports": {"tcp": {"timeout_s": 0}}}, "timeout_s"),
    ({"transports": {"tcp": {"chunk_size": "12 parsecs"}}}, "chunk_size"),
])
def test_config_errors(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_transfer_config(overrides=overrides)
    assert needle in str(ei.value)


def test_yaml_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("rules: [\n")
    with pytest.raises(ConfigError):
        load_transfer_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError):
        load_transfer_config(bad)
    with pytest.raises(ConfigError):
        load_transfer_config(tmp_path / "missing.yaml")


def test_enabled_true_but_unavailable_fails_at_startup() -> None:
    cfg = load_transfer_config(overrides={"transports": {"rdma": {"enabled": True}}})
    with pytest.raises(ConfigError) as ei:
        TransferEngine(cfg, "h")
    assert "rdma" in str(ei.value)


def test_disabled_transport_is_skipped() -> None:
    cfg = load_transfer_config(overrides={"transports": {"shm": {"enabled": False}}})
    with TransferEngine(cfg, "h") as e:
        usable = e.transports()
        assert usable["shm"] == (False, "disabled in config")
        assert usable["tcp"] == (True, "")
        assert usable["rdma"][0] is False and usable["rdma"][1]

"""Every configs/*.yaml documents exactly its config dataclass: each field once,
with the default the dataclass declares, and no key the loader would refuse."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.core.config import load_dataclass, parse_size
from kvpool.master.config import MasterConfig
from kvpool.store.config import ClientConfig
from kvpool.transfer.bulk_client import DEFAULT_SPIN_US
from kvpool.transfer.config import (
    DEFAULT_RULES,
    ServerConfig,
    TransferConfig,
    TransportSettings,
    load_transfer_config,
)
from kvpool.transfer.copy import DEFAULT_SPLIT_MIN_BYTES
from kvpool.transfer.transports import TRANSPORT_CLASSES
from kvpool.transfer.transports.rdma import RdmaOptions
from kvpool.transfer.transports.tcp import DEFAULT_STRIPE_BYTES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCRIPTS = CONFIGS.parent / "scripts"


def _keys_match(cls: type, mapping: dict[str, Any], where: str) -> list[str]:
    """Differences between ``mapping``'s keys and ``cls``'s fields, nested
    dataclass fields included."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    out = [f"{where}{k}: not a field" for k in sorted(set(mapping) - fields)]
    out += [f"{where}{k}: not documented" for k in sorted(fields - set(mapping))]
    hints = typing.get_type_hints(cls)
    for name in sorted(fields & set(mapping)):
        tp = hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _keys_match(tp, mapping[name] or {}, f"{where}{name}.")
    return out


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


def test_generated_docs_are_current() -> None:
    """master.yaml, client.yaml and docs/vllm.md's key table are
    scripts/config_docs.py's output: every field with its help text and default."""
    spec = importlib.util.spec_from_file_location("config_docs", SCRIPTS / "config_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    texts = mod.rendered()
    assert sorted(p.name for p in texts) == ["client.yaml", "master.yaml", "vllm.md"]
    stale = [p.name for p, text in texts.items() if p.read_text() != text]
    assert stale == [], "run: python scripts/config_docs.py"


def test_every_yaml_is_checked() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == [
        "client.yaml", "master.yaml", "transfer.yaml"]


@pytest.mark.parametrize(("name", "cls"), [("master.yaml", MasterConfig),
                                           ("client.yaml", ClientConfig)])
def test_yaml_documents_exactly_the_fields_and_defaults(name: str, cls: type) -> None:
    data = _load(name)
    assert _keys_match(cls, data, "") == []
    assert load_dataclass(cls, data) == cls()


def test_transfer_yaml_documents_exactly_the_fields_and_defaults() -> None:
    data = _load("transfer.yaml")
    assert set(data) == {f.name for f in dataclasses.fields(TransferConfig)}
    # server: every key with its default
    assert _keys_match(ServerConfig, data["server"], "server.") == []
    server = load_dataclass(ServerConfig, data["server"])
    server.validate()
    want = ServerConfig()
    want.validate()
    assert server == want
    # rules and per-transport settings: the built-in defaults, written out
    shipped, built_in = load_transfer_config(CONFIGS / "transfer.yaml"), load_transfer_config()
    assert shipped.rules == built_in.rules and shipped.max_failover == built_in.max_failover
    assert [r["name"] for r in data["rules"]] == [r["name"] for r in DEFAULT_RULES]
    assert set(data["transports"]) == set(TRANSPORT_CLASSES)
    for name in TRANSPORT_CLASSES:
        assert dataclasses.replace(shipped.settings_for(name), options={}) == \
            built_in.settings_for(name), name
    shm = data["transports"]["shm"]["options"]
    assert shm == {"copy_threads": 0, "split_min_bytes": "4MiB"}
    assert parse_size(shm["split_min_bytes"]) == DEFAULT_SPLIT_MIN_BYTES
    tcp = data["transports"]["tcp"]["options"]
    assert tcp == {"reply_spin_us": DEFAULT_SPIN_US, "stripe_bytes": "4MiB"}
    assert parse_size(tcp["stripe_bytes"]) == DEFAULT_STRIPE_BYTES
    # transports: sections use TransportSettings keys; the comment block lists
    # every key with the dataclass default
    ts_fields = {f.name for f in dataclasses.fields(TransportSettings)}
    for name, section in data["transports"].items():
        assert set(section or {}) <= ts_fields, name
    text = (CONFIGS / "transfer.yaml").read_text()
    block = text.split("# Per-transport settings. Keys (defaults):", 1)[1].split("\ntransports:")[0]
    documented = dict(re.findall(r"^#   (\w+): (\S+)", block, re.MULTILINE))
    assert set(documented) == ts_fields
    defaults = TransportSettings()
    for key, shown in documented.items():
        value = yaml.safe_load(shown)
        got = getattr(defaults, key)
        if key in ("chunk_size", "staging_size", "inline_max_bytes"):
            value = parse_size(value)
        assert value == got, (key, shown, got)
    # rdma options: every RdmaOptions field with its default
    opts = data["transports"]["rdma"]["options"]
    assert _keys_match(RdmaOptions, opts, "transports.rdma.options.") == []
    assert RdmaOptions.from_options(dict(opts)) == RdmaOptions.from_options({})


def test_vllm_example_uses_connector_keys() -> None:
    import json

    from kvpool.connector.config import ConnectorConfig

    extra = json.loads((CONFIGS / "vllm_kv_transfer.json").read_text())["kv_connector_extra_config"]
    cfg = ConnectorConfig.from_extra_config(extra)
    assert cfg.master_address == extra["master_address"]

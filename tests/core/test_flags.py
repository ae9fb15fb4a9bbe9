"""Command-line flags generated from the config dataclasses (kvpool.core.flags)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from kvpool.cluster.cli import build_parser
from kvpool.cluster.demo_config import DemoConfig
from kvpool.connector.config import ConnectorConfig
from kvpool.core.auth import CurveConfig
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode
from kvpool.core.flags import add_config_flags, config_from_flags, flag_settings
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.tiering_config import TieringConfig
from kvpool.store.config import ClientConfig

CONFIGS = [MasterConfig, TieringConfig, CurveConfig, ClientConfig, DemoConfig, ConnectorConfig]

# flags that scripts, tests and docs use: they must keep their names
MASTER_FLAGS = [
    "--host", "--port", "--metrics-host", "--metrics-port", "--data-dir", "--events-port",
    "--lease-ttl-ms", "--client-ttl-s", "--client-grace-s", "--eviction-high-watermark",
    "--eviction-ratio", "--put-start-discard-timeout-s", "--snapshot-interval-s",
    "--snapshot-keep", "--journal-fsync", "--max-key-length", "--max-batch-size",
    "--max-frame-size", "--promote-after-hits", "--curve", "--curve-key",
    "--curve-server-key", "--curve-allow-dir",
]
CLIENT_FLAGS = [
    "--master", "--memory", "--host-id", "--bind-host", "--port", "--segment-id", "--disk-dir",
    "--disk", "--no-prefault", "--no-guard", "--metrics-port", "--config", "--ready-file",
    "--curve", "--curve-key", "--curve-server-key", "--curve-allow-dir",
]
DEMO_FLAGS = ["--requests", "--hit-rate", "--max-chunks", "--min-value", "--max-value",
              "--memory", "--replicated", "--seed", "--system-chunks", "--progress",
              "--no-progress"]


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _parse(name: str, argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args([name, *argv])


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_setting_has_its_help_text(cls: type) -> None:
    for f in dataclasses.fields(cls):
        assert str(f.metadata.get("help") or "").strip(), f"{cls.__name__}.{f.name} has no help"


@pytest.mark.parametrize(("sub", "flags"), [("master", MASTER_FLAGS), ("client", CLIENT_FLAGS),
                                            ("demo", DEMO_FLAGS)])
def test_existing_flag_names_still_exist(sub: str, flags: list[str]) -> None:
    have = _sub(sub)._option_string_actions
    assert [f for f in flags if f not in have] == []


def test_every_scalar_master_setting_has_a_flag() -> None:
    dests = {a.dest for a in _sub("master")._actions}
    missing = [f.name for f in dataclasses.fields(MasterConfig)
               if f.metadata.get("cli", True) and f.name not in ("curve", "tiering")
               and f"config:{f.name}" not in dests]
    missing += [f.name for f in dataclasses.fields(TieringConfig)
                if f"config:tiering.{f.name}" not in dests]
    assert missing == []


def test_help_shows_the_dataclass_default() -> None:
    text = " ".join(_sub("master").format_help().split())
    assert "(default: 50051)" in text and "(default: 64MiB)" in text  # port, max_frame_size
    assert "(default: 16384)" in text  # max_batch_size is a count, not a size
    assert "(default: 256MiB)" in text  # tiering.offload_ahead_bytes


def test_master_flags_build_the_config(tmp_path: Path) -> None:
    args = _parse("master", [
        "--port", "0", "--promote-after-hits", "1", "--tiering-offload-on-evict", "false",
        "--journal-fsync", "always", "--max-frame-size", "1MiB", "--no-capabilities",
        "--curve", "off", "--client-grace-s", "1.5", "--data-dir", str(tmp_path)])
    cfg = config_from_flags(MasterConfig, args)
    want = MasterConfig(port=0, journal_fsync=FsyncPolicy.ALWAYS, max_frame_size=1 << 20,
                        capabilities=False, client_grace_s=1.5, data_dir=str(tmp_path),
                        tiering=TieringConfig(promote_after_hits=1, offload_on_evict=False),
                        curve=CurveConfig(enabled=False))
    assert cfg == want
    # no flags: the defaults, written once in the dataclass
    assert config_from_flags(MasterConfig, _parse("master", [])) == MasterConfig()


def test_flags_override_the_file_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("port: 7000\nlease_ttl_ms: 500\n"
                    "tiering: {promote_after_hits: 5, task_timeout_s: 3.0}\n"
                    "curve: {enabled: true, secret_key_file: /k}\n")
    args = _parse("master", ["--port", "7001", "--promote-after-hits", "1", "--curve", "auto"])
    assert flag_settings(args) == {"port": "7001", "tiering": {"promote_after_hits": "1"},
                                   "curve": {"enabled": None}}
    cfg = config_from_flags(MasterConfig, args, path)
    assert (cfg.port, cfg.lease_ttl_ms) == (7001, 500)
    assert (cfg.tiering.promote_after_hits, cfg.tiering.task_timeout_s) == (1, 3.0)
    assert cfg.curve == CurveConfig(enabled=None, secret_key_file="/k")


def test_client_flags_build_the_config() -> None:
    args = _parse("client", ["--master", "10.0.0.1:1", "--memory", "64MiB", "--disk", "1GiB",
                             "--disk-dir", "/d", "--no-prefault", "--no-guard", "--port", "5",
                             "--checksum", "crc32", "--curve-key", "/k"])
    cfg = config_from_flags(ClientConfig, args)
    assert cfg == ClientConfig(master_address="10.0.0.1:1", memory_size=64 << 20,
                               disk_size=1 << 30, disk_dir="/d", prefault=False, guard=False,
                               transfer_port=5, checksum="crc32",
                               curve=CurveConfig(secret_key_file="/k"))
    assert args.ready_file is None and args.config is None


@pytest.mark.parametrize(("sub", "cls", "argv", "key"), [
    ("client", ClientConfig, ["--memory", "lots"], "memory_size"),
    ("client", ClientConfig, ["--port", "http"], "transfer_port"),
    ("master", MasterConfig, ["--tiering-max-inflight-bytes", "-1"], "max_inflight_bytes"),
    ("master", MasterConfig, ["--eviction-high-watermark", "1.5"], "eviction_high_watermark"),
    ("demo", DemoConfig, ["--min-value", "32MiB"], "min-value"),
])
def test_a_bad_flag_value_is_a_config_error_naming_the_key(
        sub: str, cls: type, argv: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key) as ei:
        config_from_flags(cls, _parse(sub, argv))
    assert ei.value.code == ErrorCode.CONFIG_ERROR


def test_bad_choice_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        _parse("master", ["--journal-fsync", "sometimes"])
    with pytest.raises(SystemExit):
        _parse("client", ["--curve", "maybe"])


def test_a_subcommands_own_flag_wins() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=9)
    p.add_argument("--no-capabilities", action="store_true")  # a boolean's --no- form
    add_config_flags(p, MasterConfig)
    args = p.parse_args(["--port", "1", "--host", "h", "--no-capabilities"])
    assert args.port == 1 and args.no_capabilities
    assert flag_settings(args) == {"host": "h"}


def test_demo_flags() -> None:
    cfg = config_from_flags(DemoConfig, _parse("demo", ["--memory", "48MiB", "--max-value",
                                                        "4MiB", "--replicated", "0",
                                                        "--no-progress"]))
    assert cfg == DemoConfig(memory=48 << 20, max_value=4 << 20, replicated_fraction=0.0,
                             progress=False)


def test_one_size_parser_reads_mooncake_units_too() -> None:
    from kvpool.core.config import parse_size
    from kvpool.store.mooncake_core import mooncake_size

    assert parse_size("1GB") == 10**9 and parse_size("1GiB") == 1 << 30
    assert parse_size("1GB", binary_units=True) == mooncake_size("1GB") == 1 << 30
    assert mooncake_size("512M") == mooncake_size("512MiB") == 512 << 20
    assert mooncake_size(".5K") == 512 and mooncake_size(4096) == 4096
    with pytest.raises(ConfigError):
        parse_size("1.5B")
    for bad in ("lots", -1, True):
        with pytest.raises(Exception) as ei:
            mooncake_size(bad)
        assert getattr(ei.value, "code", None) == ErrorCode.INVALID_PARAMS

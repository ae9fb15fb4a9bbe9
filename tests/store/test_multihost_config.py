"""client_config_from_env: the client configuration of entry points that take no file.

Layers (later wins): defaults, the YAML named by KVPOOL_CONFIG, the CURVE
keys in the directory named by KVPOOL_CURVE_KEY_DIR, the caller's overrides;
a transfer-server address peers can reach when the master is remote. No
processes: the resulting ClientConfig (and its CURVE policy) is checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.core.auth import save_keypair
from kvpool.core.config import ConfigError
from kvpool.store.config import (
    CONFIG_ENV,
    CURVE_KEY_DIR_ENV,
    client_config_from_env,
    local_address_towards,
)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    save_keypair(d, "cluster")
    return d


def test_defaults_without_environment() -> None:
    cfg = client_config_from_env(environ={})
    assert cfg.master_address == "127.0.0.1:50051" and cfg.bind_host == "127.0.0.1"
    assert cfg.curve.secret_key_file == "" and not cfg.curve.active("10.0.0.2")


def test_layers_yaml_then_key_dir_then_overrides(tmp_path: Path, keys: Path) -> None:
    yaml = tmp_path / "client.yaml"
    yaml.write_text("master_address: 10.9.9.9:50051\nmemory_size: 1GiB\nrpc_timeout_s: 9\n"
                    "bind_host: 10.9.9.2\ncurve:\n  allow_any_client: true\n")
    env = {CONFIG_ENV: str(yaml), CURVE_KEY_DIR_ENV: str(keys)}
    cfg = client_config_from_env({"memory_size": "64MiB", "curve": {"enabled": None}}, environ=env)
    assert cfg.master_address == "10.9.9.9:50051"  # from the YAML
    assert cfg.memory_size == 64 << 20  # override wins, size strings accepted
    assert cfg.rpc_timeout_s == 9 and cfg.bind_host == "10.9.9.2"
    assert cfg.curve.secret_key_file == str(keys / "cluster.key_secret")  # from the key dir
    assert cfg.curve.allow_any_client is True  # YAML's curve keys kept (merged, not replaced)
    # keys configured: CURVE on off-loopback, still off on loopback
    assert cfg.curve.active("10.9.9.9") and not cfg.curve.active("127.0.0.1")
    off = client_config_from_env({"curve": {"enabled": False}}, environ=env)
    assert not off.curve.active("10.9.9.9")


def test_remote_master_gets_a_reachable_bind_address() -> None:
    cfg = client_config_from_env({"master_address": "192.0.2.1:50051"}, environ={})
    assert cfg.bind_host == local_address_towards("192.0.2.1:50051")
    kept = client_config_from_env({"master_address": "192.0.2.1:50051",
                                   "bind_host": "127.0.0.1"}, environ={})
    assert kept.bind_host == "127.0.0.1"  # an explicit choice stays
    assert local_address_towards("tcp://127.0.0.1:1") == "127.0.0.1"


def test_bad_inputs_are_config_errors(tmp_path: Path, keys: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config key"):
        client_config_from_env({"no_such_key": 1}, environ={})
    with pytest.raises(ConfigError, match="not a directory"):
        client_config_from_env(environ={CURVE_KEY_DIR_ENV: str(tmp_path / "missing")})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="keygen"):
        client_config_from_env(environ={CURVE_KEY_DIR_ENV: str(empty)})
    with pytest.raises(ConfigError, match="cannot read config"):
        client_config_from_env(environ={CONFIG_ENV: str(tmp_path / "nope.yaml")})
    (keys / "cluster.key_secret").chmod(0o644)  # a world-readable secret is refused at use
    cfg = client_config_from_env(environ={CURVE_KEY_DIR_ENV: str(keys)})
    with pytest.raises(ConfigError, match="chmod 600"):
        cfg.curve.keypair()

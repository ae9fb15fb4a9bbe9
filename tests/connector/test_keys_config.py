"""Chunk keys (deterministic chained hashing) and connector config; no vLLM needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace, chain_hashes, kv_shard
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode

KS = KeySpace(model="org/My Model", kv_dtype="torch.bfloat16", block_size=16, chunk_size=64)


def test_full_chunks_only_and_chained() -> None:
    toks = list(range(200))
    h = KS.chunk_hashes(toks)
    assert len(h) == 3  # 200 // 64; the partial tail is not a chunk
    assert KS.chunk_hashes(toks[:192]) == h
    # Changing a token in chunk 0 changes every later hash (chained over the prefix).
    toks2 = [999, *toks[1:]]
    h2 = KS.chunk_hashes(toks2)
    assert all(a != b for a, b in zip(h, h2, strict=True))
    # Changing a token in chunk 2 keeps chunks 0 and 1.
    toks3 = [*toks[:150], 7, *toks[151:]]
    assert KS.chunk_hashes(toks3)[:2] == h[:2] and KS.chunk_hashes(toks3)[2] != h[2]


def test_extend_hashes_equals_full_rehash() -> None:
    toks = list(range(1000, 1300))
    h = KS.chunk_hashes(toks[:130])
    assert KS.extend_hashes(h, toks) == KS.chunk_hashes(toks)
    assert KS.extend_hashes(KS.chunk_hashes(toks), toks[:64]) == KS.chunk_hashes(toks)[:1]


def test_hash_is_stable_across_processes() -> None:
    code = (
        "from kvpool.connector.keys import KeySpace;"
        "ks = KeySpace('org/My Model', 'torch.bfloat16', 16, 64);"
        "print(ks.chunk_hashes(list(range(200)))[-1])"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {KS.chunk_hashes(list(range(200)))[-1]}


def test_key_names_namespace() -> None:
    h = KS.chunk_hashes(list(range(64)))[0]
    k = KS.object_key(h, (0, 8), (2, 4), 8)
    assert k == f"kvpool/v3/org_My_Model/bfloat16/b16/c64/l0-8/h2-4of8/{h}"
    other = KeySpace(model="org/My Model", kv_dtype="float16", block_size=16, chunk_size=64)
    assert other.chunk_hashes(list(range(64)))[0] != h  # dtype is part of the chain seed
    # 32 layers in 4 groups, 8 heads in 2 shards: 8 objects per chunk
    keys = KS.chunk_keys(h, 32, 4, 8, 2)
    assert len(set(keys)) == 8 and keys[0].endswith(f"/l0-8/h0-4of8/{h}")
    assert keys[-1].endswith(f"/l24-32/h4-8of8/{h}")


def test_head_and_layer_splits() -> None:
    from kvpool.connector.keys import head_granularities, head_ranges, layer_ranges, rank_heads

    assert rank_heads(1, 2, 8) == (4, 8, True)
    assert rank_heads(3, 8, 2) == (0, 1, False)  # head 0 replicated on ranks 0-3: rank 0 writes
    assert rank_heads(4, 8, 2) == (1, 2, True)
    assert rank_heads(1, 2, 1) == (0, 1, False)  # MLA: one latent, rank 0 writes
    assert head_ranges(8, 2) == [(0, 4), (4, 8)]
    assert head_granularities(8, 2) == [2, 1, 4, 8]
    # short groups first (nothing computes beside the first's load), then equal
    assert layer_ranges(10, 4) == [(0, 1), (1, 4), (4, 7), (7, 10)]
    assert layer_ranges(32, 8) == [(0, 1), (1, 3), (3, 7), (7, 12), (12, 17), (17, 22),
                                   (22, 27), (27, 32)]
    # the rest would exceed 1.25 even shares: equal runs
    assert layer_ranges(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert layer_ranges(32, 16)[:3] == [(0, 1), (1, 3), (3, 5)]
    assert layer_ranges(32, 2) == [(0, 16), (16, 32)]
    assert layer_ranges(2, 4) == [(0, 1), (1, 2)]
    assert layer_ranges(7, 1) == [(0, 7)]
    for n in range(1, 70):
        for g in range(1, 20):
            r = layer_ranges(n, g)
            assert len(r) == min(n, g) and r[0][0] == 0 and r[-1][1] == n
            assert all(a < b for a, b in r) and all(r[i][1] == r[i + 1][0]
                                                    for i in range(len(r) - 1))


def test_chain_hashes_seeded() -> None:
    assert chain_hashes([1] * 8, 4, b"a") != chain_hashes([1] * 8, 4, b"b")
    assert chain_hashes([1] * 3, 4, b"a") == []


@pytest.mark.parametrize(
    ("rank", "size", "heads", "expected"),
    [(0, 1, 8, (0, 1)), (3, 4, 8, (3, 4)), (0, 8, 2, (0, 2)), (3, 8, 2, (0, 2)),
     (4, 8, 2, (1, 2)), (7, 8, 2, (1, 2)), (5, 8, 8, (5, 8))],
)
def test_kv_shard_ranks_with_identical_bytes_share(rank: int, size: int, heads: int,
                                                   expected: tuple[int, int]) -> None:
    assert kv_shard(rank, size, heads) == expected


def test_bad_geometry_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as ei:
        KeySpace("m", "bf16", block_size=16, chunk_size=40)
    assert ei.value.code == ErrorCode.CONFIG_ERROR
    with pytest.raises(ConfigError):
        kv_shard(2, 2, 4)


def test_config_from_extra_config() -> None:
    cfg = ConnectorConfig.from_extra_config(
        {"master_address": "127.0.0.1:1", "chunk_size": 64, "load_async": True})
    assert (cfg.chunk_size, cfg.load_async, cfg.save_decode) == (64, True, False)
    cfg.validate(block_size=32)
    with pytest.raises(ConfigError, match="multiple of the block size"):
        cfg.validate(block_size=48)
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorConfig.from_extra_config({"chunk_tokens": 64})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"save_decode": "maybe"})
    with pytest.raises(ConfigError, match="chunk_size"):
        ConnectorConfig.from_extra_config({"chunk_size": "lots"})
    assert ConnectorConfig.from_extra_config(None).chunk_size == 256


def test_store_client_config_for_a_multi_host_pool(tmp_path: object) -> None:
    """The connector's store ClientConfig: YAML, then overrides, then the explicit keys."""
    from pathlib import Path

    from kvpool.connector.store_access import client_config

    yaml = Path(str(tmp_path)) / "client.yaml"
    yaml.write_text("master_address: 10.0.0.1:50051\nrpc_timeout_s: 9\nbind_host: 127.0.0.1\n")
    cfg = ConnectorConfig.from_extra_config({
        "client_config": str(yaml), "master_address": "10.0.0.2:50051",
        "local_address": "10.0.0.7", "host_id": "gpu-node-7",
        "client_overrides": {"curve": {"enabled": False}, "transfer_timeout_s": 12}})
    cc = client_config(cfg)
    assert (cc.master_address, cc.bind_host, cc.host_id) == ("10.0.0.2:50051", "10.0.0.7",
                                                             "gpu-node-7")
    assert cc.curve.enabled is False and cc.transfer_timeout_s == 12
    assert cc.rpc_timeout_s == 2.0  # the connector's rpc_timeout_s beats the YAML


def test_tenant_reaches_the_store_client(tmp_path: object,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``"tenant"`` of the extra config becomes the client's tenant (over the
    YAML's); without it the YAML's holds; a bad name is a ConfigError naming it."""
    from pathlib import Path

    from kvpool.connector.store_access import client_config

    monkeypatch.delenv("KVPOOL_CONFIG", raising=False)
    yaml = Path(str(tmp_path)) / "client.yaml"
    yaml.write_text("tenant: from-yaml\n")
    assert client_config(ConnectorConfig.from_extra_config(
        {"client_config": str(yaml), "tenant": "team-a"})).tenant == "team-a"
    assert client_config(ConnectorConfig.from_extra_config(
        {"client_config": str(yaml)})).tenant == "from-yaml"
    assert client_config(ConnectorConfig.from_extra_config({})).tenant == "default"
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.tenant"):
        ConnectorConfig.from_extra_config({"tenant": "a b"})

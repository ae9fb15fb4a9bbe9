"""KV events for routers (scheduler side, no vLLM): chunks saved or found in
the pool are announced in vLLM's block hashes with kvpool's medium, chunks
that disappear are announced removed. Real master and node daemon."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.events import Medium, PoolEvents
from kvpool.connector.keys import KeySpace
from kvpool.connector.scheduler import KVPoolScheduler, NewReq, StepInfo
from kvpool.connector.store_access import StoreAccess

BLOCK, CHUNK, LAYERS = 16, 32, 2
KS = KeySpace("ev", "bf16", BLOCK, CHUNK)


@dataclass
class Req:
    """The fields of vLLM's Request the scheduler reads for events."""

    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)


def _hashes(n_blocks: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n_blocks)]


@pytest.fixture(scope="module")
def pool() -> Iterator[str]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="8MiB"):
        yield m.address


def test_lru_and_tier_moves() -> None:
    ev = PoolEvents(max_chunks=2)
    ev.stored("a", [b"1", b"2"], None, [1, 2], Medium.DRAM)
    ev.stored("a", [b"1", b"2"], None, [1, 2], Medium.DRAM)  # known: no second event
    ev.stored("a", [b"1", b"2"], None, [1, 2], Medium.DISK)  # tier moved: removed + stored
    ev.stored("b", [b"3"], b"2", [3], Medium.DRAM)
    ev.stored("c", [b"4"], b"3", [4], Medium.DRAM)  # evicts "a" from the LRU, silently
    got = [(e.stored, e.block_hashes, e.medium) for e in ev.take()]
    assert got == [(True, (b"1", b"2"), Medium.DRAM), (False, (b"1", b"2"), Medium.DRAM),
                   (True, (b"1", b"2"), Medium.DISK), (True, (b"3",), Medium.DRAM),
                   (True, (b"4",), Medium.DRAM)]
    assert not ev.known("a") and ev.known("c")
    ev.missing("c")
    ev.missing("zzz")
    assert [(e.stored, e.block_hashes) for e in ev.take()] == [(False, (b"4",))]
    assert ev.take() == []


def test_saves_and_lookups_announce_pool_blocks(pool: str) -> None:
    from kvpool.store import Client, ClientConfig

    cfg = ConnectorConfig(master_address=pool, chunk_size=CHUNK)
    s = KVPoolScheduler(cfg, KS, LAYERS, StoreAccess(cfg))
    toks = list(range(500, 570))  # 2 full chunks = 4 blocks
    req = Req(list(toks), _hashes(4, 7))
    assert s.lookup("r", toks, 0, req.block_hashes) == (0, False)
    assert s.events.take() == []  # nothing stored, nothing announced
    s.after_alloc("r", req, toks, [[1, 2, 3, 4, 5]], 0)
    s.build_meta(StepInfo(new=[NewReq("r", [[1, 2, 3, 4, 5]], 0)], num_scheduled_tokens={"r": 70}))
    ev = s.events.take()
    assert [(e.stored, e.block_hashes, e.medium) for e in ev] == [
        (True, tuple(req.block_hashes[0:2]), Medium.DRAM),
        (True, tuple(req.block_hashes[2:4]), Medium.DRAM)]
    assert ev[1].parent_block_hash == req.block_hashes[1]
    assert ev[1].token_ids == tuple(toks[32:64])
    # Another engine's chunks, found at lookup: announced once.
    other = list(range(9000, 9070))
    with Client(ClientConfig(master_address=pool)) as c:
        for h in KS.chunk_hashes(other):
            for k in KS.chunk_keys(h, LAYERS, 4):
                c.put(k, b"kv" * 512)
        blocks = _hashes(4, 9)
        assert s.lookup("q", other, 0, blocks)[0] == 64
        assert s.lookup("q2", other, 0, blocks)[0] == 64
        ev = s.events.take()
        assert [(e.stored, e.block_hashes) for e in ev] == [
            (True, tuple(blocks[0:2])), (True, tuple(blocks[2:4]))]
        # chunk 1 evicted: its blocks are announced removed at the next lookup
        c.remove(KS.chunk_keys(KS.chunk_hashes(other)[1], LAYERS, 4)[0], force=True)
        assert s.lookup("q3", other, 0, blocks)[0] == 32
        ev = s.events.take()
        assert [(e.stored, e.block_hashes, e.medium) for e in ev] == [
            (False, tuple(blocks[2:4]), Medium.DRAM)]
    s.store.close()

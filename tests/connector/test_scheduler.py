"""Scheduler-side planning against a real kvpool master + node daemon (no vLLM):
lookup of stored prefixes with one batched query, load/save plans, store down."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.metadata import WorkerReport
from kvpool.connector.scheduler import (
    CachedReq,
    KVPoolScheduler,
    NewReq,
    StepInfo,
    leading_hits,
    lookup_chunks,
    max_hit_tokens,
)
from kvpool.connector.store_access import StoreAccess

BLOCK, CHUNK, LAYERS = 16, 32, 3
KS = KeySpace("tiny", "bfloat16", BLOCK, CHUNK)


@dataclass
class FakeRequest:
    """Stand-in for vLLM's Request (not installed in this suite): the one field read."""

    all_token_ids: list[int] = field(default_factory=list)


def test_hit_limits_leave_a_token() -> None:
    assert lookup_chunks(64, 32) == 2 and lookup_chunks(63, 32) == 1
    assert max_hit_tokens(64, 16) == 48  # the block holding the last token computes
    assert max_hit_tokens(65, 16) == 64
    assert max_hit_tokens(1, 16) == 0 and max_hit_tokens(0, 16) == 0


def test_leading_hits() -> None:
    assert leading_hits([True, True, True, False, True, True], 2) == 1
    assert leading_hits([True] * 6, 3) == 2
    assert leading_hits([False, True, True, True], 2) == 0
    assert leading_hits([], 2) == 0


@pytest.fixture(scope="module")
def pool() -> Iterator[str]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="16MiB"):
        yield m.address


@pytest.fixture
def client(pool: str) -> Iterator[Any]:
    from kvpool.store import Client, ClientConfig

    with Client(ClientConfig(master_address=pool)) as c:
        c.remove_all(force=True)
        yield c


def _sched(address: str, **kw: Any) -> KVPoolScheduler:
    cfg = ConnectorConfig(master_address=address, chunk_size=CHUNK, **kw)
    return KVPoolScheduler(cfg, KS, LAYERS, StoreAccess(cfg))


def _store_chunks(client: Any, tokens: list[int], n: int, first: int = 0) -> None:
    for h in KS.chunk_hashes(tokens)[first:n]:
        for k in KS.chunk_keys(h, LAYERS, 4):
            if not client.exists(k):
                client.put(k, b"x" * 64)


def test_lookup_finds_longest_stored_run(pool: str, client: Any) -> None:
    toks = list(range(100, 200))  # 100 tokens: 3 full chunks, all usable
    _store_chunks(client, toks, 2)
    s = _sched(pool)
    assert s.lookup("r1", toks, 0) == (64, False)
    assert s.lookup("r1", toks, 32) == (32, False)  # beyond the local hit only
    assert s.lookup("r1", toks, 64) == (0, False)
    # Storing the third chunk extends the run.
    _store_chunks(client, toks, 3, first=2)
    assert s.lookup("r1", toks, 0) == (96, False)
    # Exactly 3 chunks of prompt: the last block must be computed (>= 1 token).
    assert s.lookup("r2", toks[:96], 0) == (80, False)
    # A gap at chunk 0 means no hit at all.
    other = list(range(5000, 5100))
    _store_chunks(client, other, 3)
    client.remove(KS.chunk_keys(KS.chunk_hashes(other)[0], LAYERS, 4)[1], force=True)
    assert s.lookup("r3", other, 0) == (0, False)
    assert _sched(pool, load_async=True).lookup("r4", toks, 0) == (96, True)


def test_load_plan_uses_allocated_blocks(pool: str, client: Any) -> None:
    toks = list(range(100))
    _store_chunks(client, toks, 3)
    s = _sched(pool)
    n, _ = s.lookup("r", toks, 16)  # one block computed locally (vLLM prefix cache)
    assert n == 80
    blocks = [7, 8, 3, 4, 9, 10, 11]
    s.after_alloc("r", FakeRequest(toks), toks, [blocks], n)
    meta = s.build_meta(StepInfo(new=[NewReq("r", [blocks], 96)],
                                 num_scheduled_tokens={"r": 4}))
    (load,) = meta.loads
    assert [c.index for c in load.chunks] == [0, 1, 2]
    assert [c.block_ids for c in load.chunks] == [[7, 8], [3, 4], [9, 10]]
    assert load.skip_blocks == 1 and not load.is_async
    assert [c.hash for c in load.chunks] == KS.chunk_hashes(toks)
    assert meta.saves == []  # every full chunk is already stored
    assert s.stats.totals()["hit_tokens"] == 80
    assert s.build_meta(StepInfo()).loads == []  # loads are handed out once


def test_chunk_ending_at_prompt_end_loads_all_but_last_block(pool: str, client: Any) -> None:
    toks = list(range(300, 396))  # 96 tokens = exactly 3 chunks
    _store_chunks(client, toks, 3)
    s = _sched(pool)
    assert s.lookup("r", toks, 0) == (80, False)
    blocks = [4, 5, 6, 7, 8, 9]
    s.after_alloc("r", FakeRequest(toks), toks, [blocks], 80)
    (load,) = s.build_meta(StepInfo(new=[NewReq("r", [blocks], 80)],
                                    num_scheduled_tokens={"r": 16})).loads
    assert [c.block_ids for c in load.chunks] == [[4, 5], [6, 7], [8, 9]]
    assert load.skip_blocks == 0 and load.last_blocks == 1


def test_saves_planned_once_as_chunks_complete(pool: str, client: Any) -> None:
    toks = list(range(1000, 1090))  # 90-token prompt: 2 full chunks
    s = _sched(pool)
    assert s.lookup("r", toks, 0) == (0, False)
    blocks = [1, 2, 3, 4, 5, 6]
    s.after_alloc("r", FakeRequest(list(toks)), toks, [blocks], 0)
    # Chunked prefill: 40 tokens this step -> chunk 0 complete.
    m1 = s.build_meta(StepInfo(new=[NewReq("r", [blocks], 0)], num_scheduled_tokens={"r": 40}))
    assert [(sv.req_id, [c.index for c in sv.chunks]) for sv in m1.saves] == [("r", [0])]
    assert m1.saves[0].chunks[0].block_ids == [1, 2]
    m2 = s.build_meta(StepInfo(cached=[CachedReq("r", [[]], 40)], num_scheduled_tokens={"r": 50}))
    assert [c.index for c in m2.saves[0].chunks] == [1]
    assert m2.saves[0].chunks[0].hash == KS.chunk_hashes(toks)[1]
    m3 = s.build_meta(StepInfo(cached=[CachedReq("r", [[7]], 90)], num_scheduled_tokens={"r": 1}))
    assert m3.saves == []  # decode tokens are not saved by default
    assert s.finished("r") is True  # saves were queued: vLLM must wait for the worker
    assert s.finished("never-saved") is False


def test_decode_chunks_saved_when_enabled(pool: str, client: Any) -> None:
    toks = list(range(40))
    req = FakeRequest(list(toks))
    s = _sched(pool, save_decode=True)
    s.lookup("r", toks, 0)
    s.after_alloc("r", req, toks, [[1, 2, 3]], 0)
    m = s.build_meta(StepInfo(new=[NewReq("r", [[1, 2, 3]], 0)], num_scheduled_tokens={"r": 40}))
    assert [c.index for c in m.saves[0].chunks] == [0]
    req.all_token_ids += list(range(500, 525))  # 65 tokens, 64 computed after next step
    m = s.build_meta(StepInfo(cached=[CachedReq("r", [[4]], 63)], num_scheduled_tokens={"r": 1}))
    (save,) = m.saves
    assert [c.index for c in save.chunks] == [1] and save.chunks[0].block_ids == [3, 4]
    assert save.chunks[0].hash == KS.chunk_hashes(req.all_token_ids)[1]


def test_preempted_request_resumes_with_new_blocks(pool: str, client: Any) -> None:
    toks = list(range(70))
    s = _sched(pool)
    s.lookup("r", toks, 0)
    s.after_alloc("r", FakeRequest(toks), toks, [[1, 2]], 0)
    m = s.build_meta(StepInfo(new=[NewReq("r", [[1, 2]], 0)], num_scheduled_tokens={"r": 32}))
    assert m.saves[0].chunks[0].block_ids == [1, 2]
    m = s.build_meta(StepInfo(preempted_req_ids={"r"}))
    assert m.preempted_req_ids == ["r"]
    m = s.build_meta(StepInfo(cached=[CachedReq("r", [[8, 9, 10, 11, 12]], 0, resumed=True)],
                              num_scheduled_tokens={"r": 70}))
    assert [c.block_ids for c in m.saves[0].chunks] == [[10, 11]]  # chunk 0 was stored


def test_store_down_is_a_fast_miss() -> None:
    from kvpool.cluster.processes import find_free_port

    cfg = ConnectorConfig(master_address=f"127.0.0.1:{find_free_port()}", chunk_size=CHUNK,
                          rpc_timeout_s=0.3, retry_interval_s=60)
    store = StoreAccess(cfg)
    s = KVPoolScheduler(cfg, KS, LAYERS, store)
    toks = list(range(100))
    assert s.lookup("r", toks, 0) == (0, False)
    assert store.failures == 1 and store.is_down
    for i in range(20):  # circuit open: later lookups do not try to connect again
        assert s.lookup(f"q{i}", toks, 0) == (0, False)
    assert store.failures == 1
    assert s.stats.totals()["lookup_errors"] == 21


def test_roles_consumer_never_saves_producer_never_loads(pool: str, client: Any) -> None:
    toks = list(range(7000, 7070))
    _store_chunks(client, toks, 2)
    cfg = ConnectorConfig(master_address=pool, chunk_size=CHUNK)
    producer = KVPoolScheduler(cfg, KS, LAYERS, StoreAccess(cfg), load=False)
    assert producer.lookup("p", toks, 0) == (0, False)
    consumer = KVPoolScheduler(cfg, KS, LAYERS, StoreAccess(cfg), save=False)
    assert consumer.lookup("c", toks, 0) == (64, False)
    consumer.after_alloc("c", FakeRequest(toks), toks, [[1, 2, 3, 4, 5]], 64)
    m = consumer.build_meta(StepInfo(new=[NewReq("c", [[1, 2, 3, 4, 5]], 64)],
                                     num_scheduled_tokens={"c": 6}))
    assert len(m.loads) == 1 and m.saves == []


def test_abort_during_async_load_keeps_blocks_until_loaded(pool: str, client: Any) -> None:
    toks = list(range(8000, 8070))
    _store_chunks(client, toks, 2)
    s = _sched(pool, load_async=True)
    assert s.lookup("a", toks, 0) == (64, True)
    s.after_alloc("a", FakeRequest(toks), toks, [[1, 2, 3, 4, 5]], 64)
    assert s.build_meta(StepInfo()).loads[0].is_async
    s.loads_done({"other"})
    assert s.finished("a") is True  # the worker may still be writing into the blocks
    assert s.lookup("b", toks, 0) == (64, True)
    s.after_alloc("b", FakeRequest(toks), toks, [[6, 7, 8, 9, 10]], 64)
    s.loads_done({"b"})
    assert s.finished("b") is False


def test_sliding_window_saves_only_held_blocks_and_flushes_before_reuse() -> None:
    """Two KV-cache groups, the first a 16-token sliding window: a chunk whose
    window blocks vLLM freed before the step saves them as -1 (not stored),
    and a step that hands a block an earlier save reads to another request
    makes the workers finish their saves before the forward."""
    from kvpool.connector.keys import CacheGroup

    cfg = ConnectorConfig(master_address="127.0.0.1:1", chunk_size=CHUNK)
    s = KVPoolScheduler(cfg, KS, [CacheGroup(2, 16), CacheGroup(1)], StoreAccess(cfg))
    toks = list(range(1000, 1070))
    sw, full = [1, 2, 3, 4], [11, 12, 13, 14]
    s.after_alloc("r", FakeRequest(toks), toks, [sw, full], 0)
    m1 = s.build_meta(StepInfo(new=[NewReq("r", [sw, full], 0)], num_scheduled_tokens={"r": 63}))
    (save,) = m1.saves  # chunk 0 (tokens 0-31): every block still held
    assert [(c.index, c.block_ids) for c in save.chunks] == [(0, [1, 2, 11, 12])]
    assert not m1.flush_saves
    # Step 2 starts at 63 tokens: the window keeps tokens 48.. (block 3 on), so
    # vLLM freed blocks 1-3 (as the window moved) and gives block 1 to request q.
    m2 = s.build_meta(StepInfo(new=[NewReq("q", [[1], [21]], 0)],
                               cached=[CachedReq("r", [[], []], 63)],
                               num_scheduled_tokens={"r": 1, "q": 8}))
    assert m2.flush_saves  # step 1's save reads block 1
    (save,) = [sv for sv in m2.saves if sv.req_id == "r"]
    # chunk 1 (tokens 32-63): block 3 (tokens 32-47) left the window: not saved
    assert [(c.index, c.block_ids) for c in save.chunks] == [(1, [-1, 4, 13, 14])]
    m3 = s.build_meta(StepInfo(cached=[CachedReq("r", None, 64)],
                               num_scheduled_tokens={"r": 1}))
    assert not m3.flush_saves and not m3.saves


# ---------------------------------------------------------------- recurrent state

STATE_KS = KeySpace("tiny-gdn", "bfloat16", BLOCK, BLOCK)  # a state model: chunk = block
STATE_LAYERS = 2  # layers of the one state group


class RecordingPins:
    """Records pins (vLLM's block pool is not installed in this suite; the
    vLLM e2e test runs the real one)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}

    def pin(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.held[b] = self.held.get(b, 0) + 1

    def unpin(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.held[b] -= 1
            if not self.held[b]:
                del self.held[b]


def _state_sched(address: str) -> KVPoolScheduler:
    cfg = ConnectorConfig(master_address=address, chunk_size=BLOCK, load_or_recompute=False,
                          load_async=True)
    return KVPoolScheduler(cfg, STATE_KS, LAYERS, StoreAccess(cfg),
                           state_groups=[STATE_LAYERS], state_ranks=1)


def _store_state_model(client: Any, tokens: list[int], chunks: int, states: list[int]) -> None:
    """KV of the first ``chunks`` chunks, and the state after each chunk of ``states``."""
    hashes = STATE_KS.chunk_hashes(tokens)
    for h in hashes[:chunks]:
        for k in STATE_KS.chunk_keys(h, LAYERS, 4):
            client.put(k, b"k" * 64)
    for i in states:
        for k in STATE_KS.state_keys(hashes[i], 0, STATE_LAYERS, 1):
            client.put(k, b"s" * 64)


def test_a_state_model_hits_only_where_a_state_is_stored(pool: str, client: Any) -> None:
    """Every chunk's KV stored, states after chunks 1 and 3 (of 6): the hit
    ends at the last chunk whose state is stored (4 chunks), and the load
    carries that state into the block of the hit's last position."""
    toks = list(range(300, 300 + 6 * BLOCK + 5))
    _store_state_model(client, toks, 6, [1, 3])
    s = _state_sched(pool)
    assert s.lookup("a", toks, 0) == (4 * BLOCK, True)
    kv_blocks = [list(range(10, 17))]
    state_blocks = [[-1, -1, -1, 40, 41]]  # vLLM: null blocks, the hit's state, the running one
    s.after_alloc("a", None, toks, kv_blocks, 4 * BLOCK, state_blocks)
    (load,) = s.build_meta(StepInfo()).loads
    assert [c.index for c in load.chunks] == [0, 1, 2, 3]
    assert [(r.group, r.index, r.block_id) for r in load.states] == [(0, 3, 40)]
    assert load.states[0].hash == STATE_KS.chunk_hashes(toks)[3]
    # a table without the block there: the load carries -1 (the worker fails it)
    s.lookup("b", toks, 0)
    s.after_alloc("b", None, toks, kv_blocks, 4 * BLOCK, [[-1]])
    (load_b,) = s.build_meta(StepInfo()).loads
    assert [r.block_id for r in load_b.states] == [-1]


def test_a_prefix_without_its_state_is_a_miss(pool: str, client: Any) -> None:
    toks = list(range(500, 500 + 3 * BLOCK + 1))
    _store_state_model(client, toks, 3, [])
    s = _state_sched(pool)
    assert s.lookup("a", toks, 0) == (0, False)
    # the lookup asks for each rank's last layer (the load checks every layer)
    hashes = STATE_KS.chunk_hashes(toks)
    client.put(STATE_KS.state_key(hashes[2], 0, 0, 0, 1), b"s" * 64)
    assert s.lookup("b", toks, 0) == (0, False)
    client.put(STATE_KS.state_key(hashes[2], 0, 1, 0, 1), b"s" * 64)
    assert s.lookup("c", toks, 0) == (3 * BLOCK, True)
    assert STATE_KS.state_probe_keys(hashes[2], 0, 2, 1) == [
        STATE_KS.state_key(hashes[2], 0, 1, 0, 1)]
    # a state written by an engine with another TP size is not this one's
    two = KVPoolScheduler(s.cfg, STATE_KS, LAYERS, s.store, state_groups=[STATE_LAYERS],
                          state_ranks=2)
    assert two.lookup("d", toks, 0) == (0, False)


def test_state_hand_offs_are_saved_and_their_blocks_pinned_until_saved(pool: str) -> None:
    toks = list(range(700, 700 + 5 * BLOCK + 3))
    s = _state_sched(pool)
    pins = RecordingPins()
    s.pins = pins
    s.lookup("r", toks, 0)
    s.after_alloc("r", None, toks, [[1, 2, 3, 4]], 0, [[-1, -1, -1, 9]])
    # the step computing 4 blocks: vLLM checkpoints the state at 4 blocks into
    # block 9, and one at a sub-block position (ignored: no hit ends there)
    meta = s.build_meta(StepInfo(
        new=[NewReq("r", [[1, 2, 3, 4]], 0, toks)], num_scheduled_tokens={"r": 4 * BLOCK},
        state_offloads={"r": [(0, 9, 4 * BLOCK), (0, 12, 4 * BLOCK - 3)]}))
    (save,) = meta.saves
    assert [c.index for c in save.chunks] == [0, 1, 2, 3]
    assert [(r.index, r.block_id) for r in save.states] == [(3, 9)]
    assert save.states[0].hash == STATE_KS.chunk_hashes(toks)[3]
    assert pins.held == {9: 1}
    # the next chunk and its state
    meta2 = s.build_meta(StepInfo(
        cached=[CachedReq("r", [[5]], 4 * BLOCK)], num_scheduled_tokens={"r": BLOCK},
        state_offloads={"r": [(0, 13, 5 * BLOCK)]}))
    (save2,) = meta2.saves
    assert [c.index for c in save2.chunks] == [4]
    assert [(r.index, r.block_id) for r in save2.states] == [(4, 13)]
    # a state handed over for chunks already stored (a hit's loaded state): saved
    # alone (the store keeps the first copy)
    meta3 = s.build_meta(StepInfo(
        cached=[CachedReq("r", None, 5 * BLOCK)], num_scheduled_tokens={"r": 1},
        state_offloads={"r": [(0, 14, 2 * BLOCK)]}))
    (save3,) = meta3.saves
    assert save3.chunks == [] and [(r.index, r.block_id) for r in save3.states] == [(1, 14)]
    assert pins.held == {9: 1, 13: 1, 14: 1}
    # a worker reports the first save done: its block goes (the request runs on)
    s.observe(WorkerReport(states_saved=[save.states[0].pin]))
    assert pins.held == {13: 1, 14: 1}
    # finished: vLLM keeps the blocks until the saves are reported, then unpinned
    assert s.finished("r") is True
    assert pins.held == {13: 1, 14: 1}
    s.saves_done({"r"})
    assert pins.held == {}
    s.saves_done({"r"})  # reported twice: nothing left to unpin
    s.observe(WorkerReport(states_saved=[save2.states[0].pin]))  # a late report
    assert pins.held == {}


def test_a_state_block_goes_once_every_rank_saved_it(pool: str) -> None:
    cfg = ConnectorConfig(master_address=pool, chunk_size=BLOCK)
    s = KVPoolScheduler(cfg, STATE_KS, LAYERS, StoreAccess(cfg), state_groups=[STATE_LAYERS],
                        state_ranks=2)
    pins = RecordingPins()
    s.pins = pins
    toks = list(range(900, 900 + 2 * BLOCK + 1))
    s.lookup("r", toks, 0)
    s.after_alloc("r", None, toks, [[1, 2]], 0, [[-1, 7]])
    (save,) = s.build_meta(StepInfo(new=[NewReq("r", [[1, 2]], 0, toks)],
                                    num_scheduled_tokens={"r": 2 * BLOCK},
                                    state_offloads={"r": [(0, 7, 2 * BLOCK)]})).saves
    pin = save.states[0].pin
    s.observe(WorkerReport(states_saved=[pin]))  # rank 0
    assert pins.held == {7: 1}
    s.observe(WorkerReport(states_saved=[pin]))  # rank 1 (vLLM merges ranks' reports)
    assert pins.held == {}

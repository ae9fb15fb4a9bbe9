"""Scheduler side of the connector: prefix lookup and per-step load/save plans.

No vLLM import: :mod:`kvpool.connector.vllm` adapts vLLM's ``Request`` and
``SchedulerOutput`` to the small structures used here.

Per request the scheduler tracks the block ids vLLM gave it (one list per
KV-cache group), the chunk hashes of its tokens and how many leading chunks
are stored (or queued for storing). Each step, chunks whose tokens are all
computed after the step become saves; the worker writes them after the
forward.

Hybrid models (vLLM's hybrid KV-cache manager, several KV-cache groups,
:class:`~kvpool.connector.keys.CacheGroup`): a chunk is stored per group. A
sliding-window group holds only the blocks inside its window: a save stores
the blocks it still holds, and a hit of ``E`` tokens needs that group's
objects only for the chunks of the window before ``E`` (vLLM gives the
blocks before it as null blocks, -1 here); full-attention groups need every
chunk. A hit is the longest prefix for which every needed object is stored.

Recurrent state (Mamba / linear-attention groups, passed apart from the
KV-cache groups above: ``state_groups``): vLLM checkpoints a state at some
block boundaries and hands the exact block over (``StepInfo.state_offloads``);
it is saved under the hash of the chunk it ends, and its block is pinned
(:class:`BlockPins`) until every worker reported that save done (or the
request's saves are done), since vLLM frees a state block from the
request's table before the request ends. A hit then
needs, beside the KV of every chunk, the state of every state group at its
last chunk: a prefix without it is a miss, never a partial load. The lookup
asks for each rank's last layer of a state (one key per chunk, group and
rank instead of one per layer: a 36-layer model would multiply the lookup's
keys); a state its load finds incomplete fails that load, and vLLM
recomputes the request.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.estimate import ChunkCost, Decision, SpeedBook, decide, peer_key
from kvpool.connector.events import Medium, PoolEvents
from kvpool.connector.keys import (
    CacheGroup,
    KeySpace,
    first_window_block,
    head_granularities,
    head_ranges,
    layer_ranges,
)
from kvpool.connector.metadata import (
    ChunkRef,
    ConnectorMeta,
    LoadSpec,
    SaveSpec,
    StateRef,
    WorkerReport,
)
from kvpool.connector.stats import ConnectorStats
from kvpool.connector.store_access import StoreAccess, StoreUnavailable
from kvpool.core.errors import KVPoolError
from kvpool.store.located import Located

__all__ = [
    "BlockPins",
    "CachedReq",
    "KVPoolScheduler",
    "Lookup",
    "NewReq",
    "StepInfo",
    "leading_hits",
    "lookup_chunks",
    "max_hit_tokens",
]

log = logging.getLogger("kvpool.connector")


def lookup_chunks(num_prompt_tokens: int, chunk_size: int) -> int:
    """Full chunks of a prompt (the ones a lookup checks)."""
    return max(0, num_prompt_tokens // chunk_size)


def max_hit_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Most prompt tokens a hit may cover: whole blocks, always leaving >= 1
    prompt token to compute (vLLM needs one to produce logits). A chunk that
    ends at the prompt's end is loaded without its last block."""
    return max(0, (num_prompt_tokens - 1) // block_size * block_size)


def leading_hits(exists: Sequence[bool], per_chunk: int) -> int:
    """Leading chunks whose ``per_chunk`` consecutive existence flags are all true."""
    n = 0
    for i in range(0, len(exists) - per_chunk + 1, per_chunk):
        if not all(exists[i : i + per_chunk]):
            break
        n += 1
    return n


@dataclass
class Lookup:
    """Result of a prefix lookup: chunk hashes, how many lead chunks are stored,
    and how many of them to load (the load-or-recompute decision)."""

    hashes: list[str]
    hit_chunks: int  # leading chunks stored
    hit_tokens: int  # tokens a load covers (see max_hit_tokens), after the decision
    decision: Decision | None = None
    peers: list[str] = field(default_factory=list)  # per stored chunk
    splits: list[int] = field(default_factory=list)  # per stored chunk: head objects
    located: list[Any] = field(default_factory=list)  # the lookup's replies (store Located)


class BlockPins(Protocol):
    """Holds vLLM blocks past their request's table (vLLM's block pool:
    ``touch`` and ``free_blocks``): a state block a save still reads."""

    def pin(self, block_ids: list[int]) -> None: ...

    def unpin(self, block_ids: list[int]) -> None: ...


@dataclass
class NewReq:
    """A request scheduled for the first time (or from waiting) this step."""

    req_id: str
    block_ids: list[list[int]]  # per KV-cache group (-1: vLLM's null block)
    num_computed_tokens: int
    prompt_token_ids: list[int] | None = None


@dataclass
class CachedReq:
    """A request already running (or resumed after preemption) this step."""

    req_id: str
    new_block_ids: list[list[int]] | None  # per KV-cache group
    num_computed_tokens: int
    resumed: bool = False


@dataclass
class StepInfo:
    """The parts of vLLM's SchedulerOutput the connector reads."""

    new: list[NewReq] = field(default_factory=list)
    cached: list[CachedReq] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # per request: (state group, block id, tokens) of each recurrent state
    # vLLM checkpointed this step (its blocks hold it after the forward)
    state_offloads: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


@dataclass
class _ReqState:
    request: Any  # vLLM Request (all_token_ids grows with decoding) or None
    prompt: list[int]
    hashes: list[str]
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    stored_chunks: int = 0  # leading chunks stored or queued for saving
    had_saves: bool = False


class KVPoolScheduler:
    """Scheduler-side connector logic. Methods mirror KVConnectorBase_V1's."""

    def __init__(self, cfg: ConnectorConfig, keys: KeySpace,
                 num_layers: int | Sequence[CacheGroup], store: StoreAccess,
                 stats: ConnectorStats | None = None,
                 load: bool = True, save: bool = True, num_heads: int = 1,
                 head_objects: int = 1, state_groups: Sequence[int] = (),
                 state_ranks: int = 1) -> None:
        """``num_layers``: the model's layers (one full-attention KV-cache
        group), or its KV-cache groups. ``load``/``save``: vLLM's kv_role
        (kv_consumer only loads, kv_producer only saves, kv_both does both).
        ``num_heads``: the model's KV heads (1 for MLA); ``head_objects``: the
        objects this engine's ranks store per chunk and layer group (its
        distinct KV shards). ``state_groups``: the layers of each recurrent
        state group (the chunk size must then be the block size: states
        are checkpointed at block boundaries), stored by ``state_ranks``
        tensor-parallel ranks. Set :attr:`pins` before a state is saved."""
        self.cfg = cfg
        self.load_enabled = load
        self.save_enabled = save
        self.keys = keys
        self.cache_groups = ([CacheGroup(num_layers)] if isinstance(num_layers, int)
                             else list(num_layers))
        self.num_layers = sum(g.num_layers for g in self.cache_groups)
        self.store = store
        self.stats = stats or ConnectorStats()
        self._lookups: dict[str, Lookup] = {}
        self._reqs: dict[str, _ReqState] = {}
        self._loads: list[LoadSpec] = []
        self._async_loading: set[str] = set()  # async loads not reported done yet
        self._load_blocks: dict[str, set[int]] = {}  # blocks each planned load writes
        self._no_load: set[str] = set()  # requests whose load failed: never offered again
        self.num_heads = num_heads
        self.head_objects = head_objects
        # per KV-cache group: its layer groups (objects per chunk and head range)
        self.layer_ranges = [layer_ranges(g.num_layers, cfg.layer_groups)
                             for g in self.cache_groups]
        self._sw_saving: set[int] = set()  # sliding-window blocks read by saves
        self.splits = head_granularities(num_heads, head_objects)
        self.speeds = SpeedBook(reprobe_s=cfg.reprobe_s)
        self.events = PoolEvents()
        self.state_groups = list(state_groups)
        self.state_ranks = state_ranks
        if self.state_groups and keys.blocks_per_chunk != 1:
            raise ValueError("recurrent state needs chunks of one block")
        self.pins: BlockPins | None = None
        self._pinned: dict[str, list[int]] = {}  # request -> pins of its state saves
        # pin -> (its block, worker reports still to come): every rank saves its state
        self._pin_waits: dict[int, tuple[int, int]] = {}
        self._pin_ids = itertools.count()

    # ------------------------------------------------------------ lookup

    def lookup(self, req_id: str, prompt_token_ids: Sequence[int],
               num_computed_tokens: int, block_hashes: Sequence[Any] = ()) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: tokens beyond ``num_computed_tokens``
        that kvpool holds (a run of whole chunks from the prompt start, found
        with one batched existence query), and whether they load asynchronously.
        A store that is down means 0 (the request computes normally)."""
        n = lookup_chunks(len(prompt_token_ids), self.keys.chunk_size) if self.load_enabled else 0
        if req_id in self._no_load:
            n = 0  # its load failed once: computing it must not wait on the store again
        limit = max_hit_tokens(len(prompt_token_ids), self.keys.block_size)
        hashes = self.keys.chunk_hashes(prompt_token_ids[: n * self.keys.chunk_size])
        hit = 0
        valid: list[bool] = [True]
        peers: list[str] = []
        sizes: list[int] = []
        splits: list[int] = []
        located: list[Any] = []
        if n and min(n * self.keys.chunk_size, limit) > num_computed_tokens:
            try:
                valid, peers, sizes, splits, located = self._find(hashes, limit)
                hit = max(h for h, ok in enumerate(valid) if ok)
                if block_hashes:
                    self._announce(hashes, hit, peers, prompt_token_ids, block_hashes)
            except Exception as exc:  # the store never fails a request: a miss
                if not isinstance(exc, StoreUnavailable | KVPoolError):
                    log.warning("kvpool lookup failed (treated as a miss): %r", exc)
                self.stats.add(lookup_errors=1)
                hit = 0
        decision = None
        if hit and self.cfg.load_or_recompute:
            decision = self._decide(hit, peers, sizes, limit, num_computed_tokens)
            # fewer chunks move a sliding window: the longest valid prefix within
            hit = max(h for h in range(decision.chunks + 1) if valid[h])
        hit_tokens = min(hit * self.keys.chunk_size, limit)
        self._lookups[req_id] = Lookup(hashes, hit, hit_tokens, decision, peers, splits,
                                       located)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.cfg.load_async

    def _announce(self, hashes: list[str], hit: int, peers: list[str],
                  tokens: Sequence[int], block_hashes: Sequence[Any]) -> None:
        """KV events from a lookup: chunks found are in the pool (for this engine
        too), announced chunks not found are gone."""
        for i in range(hit):
            medium = Medium.DISK if i < len(peers) and peers[i].startswith("disk") \
                else Medium.DRAM
            self._event_stored(hashes[i], i, tokens, block_hashes, medium)
        if hit < len(hashes) and self.events.known(hashes[hit]):
            for h in hashes[hit:]:
                self.events.missing(h)

    def _event_stored(self, chunk_hash: str, i: int, tokens: Sequence[int],
                      block_hashes: Sequence[Any], medium: Medium) -> None:
        bpc, cs = self.keys.blocks_per_chunk, self.keys.chunk_size
        if len(block_hashes) < (i + 1) * bpc:
            return
        self.events.stored(chunk_hash, block_hashes[i * bpc : (i + 1) * bpc],
                           block_hashes[i * bpc - 1] if i else None,
                           tokens[i * cs : (i + 1) * cs], medium)

    def _keys(self, h: str, split: int, c: int = 0) -> list[str]:
        """Every object key of KV-cache group ``c`` of chunk ``h`` stored as
        ``split`` head objects."""
        return self.keys.chunk_keys(h, self.cache_groups[c].num_layers, self.cfg.layer_groups,
                                    self.num_heads, split, (c, len(self.cache_groups)))

    def needed_chunks(self, end: int, c: int) -> range:
        """The chunks of KV-cache group ``c`` a hit of ``end`` tokens loads
        (a sliding-window group: only those of its window)."""
        cs, bs = self.keys.chunk_size, self.keys.block_size
        first = first_window_block(end, self.cache_groups[c].window, bs) // (cs // bs)
        return range(first, -(-end // cs))

    def _find(self, hashes: list[str], limit: int
              ) -> tuple[list[bool], list[str], list[int], list[int], list[Any]]:
        """Which leading runs of ``hashes`` are hits: every object a load of
        them needs is stored (:meth:`needed_chunks`). One RPC for this
        engine's head split of every chunk; when some chunk lacks objects, one
        more for every other TP size's split of those chunks. A chunk is read
        in one split: the first whose full-attention groups are complete (any
        group, for a model without one). Returns (per run length ``h`` in
        ``0..len(hashes)``: a hit?, then per chunk: peer, bytes one rank
        reads, head split; the RPCs' replies: the load reads its first layer
        group from them)."""
        n = len(hashes)
        C = len(self.cache_groups)
        replies: list[Any] = []
        # (chunk, split, group) -> all objects stored; (chunk, split) -> (peer, bytes)
        have: dict[tuple[int, int, int], bool] = {}
        info: dict[tuple[int, int], tuple[str, int]] = {}
        full = [c for c, g in enumerate(self.cache_groups) if g.window is None] or list(range(C))

        state_ok = [True] * n  # every state group's state after chunk i is stored

        def query(chunks: list[int], splits: list[int], states: bool = False) -> None:
            keys: list[str] = []
            where: dict[tuple[int, int, int], tuple[int, int]] = {}
            for i in chunks:
                for sp in splits:
                    for c in range(C):
                        ks = self._keys(hashes[i], sp, c)
                        where[(i, sp, c)] = (len(keys), len(ks))
                        keys.extend(ks)
            s0 = len(keys)
            if states:
                for i in chunks:
                    for s, nl in enumerate(self.state_groups):
                        keys.extend(self.keys.state_probe_keys(hashes[i], s, nl,
                                                               self.state_ranks))
            locs, located = self.store.batch_locate(keys)
            replies.append(located)
            if states:
                per = len(self.state_groups) * self.state_ranks  # probe keys per chunk
                for k, i in enumerate(chunks):
                    a = s0 + k * per
                    state_ok[i] = all(locs[j] is not None for j in range(a, a + per))
            for (i, sp, c), (k0, cnt) in where.items():
                found = [locs[k] for k in range(k0, k0 + cnt)]
                have[(i, sp, c)] = ok = all(loc is not None for loc in found)
                if not ok:
                    continue
                size = sum(loc[0].size for loc in found) // min(sp, self.head_objects)
                known = info.get((i, sp))
                if known is None:  # the chunk's peer: its first complete group's
                    near = found[0][0]
                    info[(i, sp)] = (peer_key(near.kind, near.same_host, near.host_id), size)
                else:
                    info[(i, sp)] = (known[0], known[1] + size)

        def complete(i: int, sp: int) -> bool:
            return all(have.get((i, sp, c), False) for c in full)

        own = self.splits[0]
        if n:
            query(list(range(n)), [own], states=bool(self.state_groups))
        lacking = [i for i in range(n) if not all(have[(i, own, c)] for c in range(C))]
        if lacking and len(self.splits) > 1:
            query(lacking, self.splits[1:])
        chosen = [next((sp for sp in self.splits if complete(i, sp)), None) for i in range(n)]
        cs = self.keys.chunk_size
        def stored(i: int, c: int) -> bool:
            sp = chosen[i]
            return sp is not None and have.get((i, sp, c), False)

        # a full-attention group needs every chunk before the end: its run from 0
        lead = {c: next((i for i in range(n) if not stored(i, c)), n)
                for c, g in enumerate(self.cache_groups) if g.window is None}
        valid = [True] + [False] * n
        for h in range(1, n + 1):
            end = min(h * cs, limit)
            if end <= 0 or -(-end // cs) != h:  # the limit cuts it: the same as a shorter run
                continue
            valid[h] = all(h <= lead[c] if c in lead else
                           all(stored(i, c) for i in self.needed_chunks(end, c))
                           for c in range(C))
            if self.state_groups:  # resumable only where the states are
                valid[h] = valid[h] and end == h * cs and state_ok[h - 1]
        peers = [info.get((i, sp), ("", 0))[0] if sp is not None else "" for i, sp in
                 enumerate(chosen)]
        sizes = [info.get((i, sp), ("", 0))[1] if sp is not None else 0 for i, sp in
                 enumerate(chosen)]
        splits = [sp if sp is not None else own for sp in chosen]
        return valid, peers, sizes, splits, replies

    def _decide(self, hit: int, peers: list[str], sizes: list[int], limit: int,
                computed: int) -> Decision:
        """Load or recompute the ``hit`` stored leading chunks (estimate.decide);
        chunks wholly inside the local prefix cache cost nothing either way."""
        cs = self.keys.chunk_size
        first = min(computed // cs, hit)
        costs = []
        for i in range(first, hit):
            start, end = max(i * cs, computed), min((i + 1) * cs, limit)
            if end <= start:
                break
            costs.append(ChunkCost(peers[i], sizes[i], end - start))
        d = decide(self.speeds, costs, self.cfg.load_timeout_s, self.cfg.probe_fraction)
        d.chunks += first
        return d

    def observe(self, report: WorkerReport | None) -> None:
        """``update_connector_output``: the workers' measurements (SpeedBook),
        and the state saves they finished (their blocks are unpinned)."""
        if report is None:
            return
        for peer, nbytes, seconds in report.loads:
            self.speeds.observe_load(peer, nbytes, seconds)
        for peer in report.failed_peers:
            self.speeds.observe_failure(peer)
        for tokens, seconds in report.forwards:
            self.speeds.observe_prefill(tokens, seconds)
        if report.states_saved:
            self._states_saved(report.states_saved)

    # ------------------------------------------------------------ allocation

    def after_alloc(self, req_id: str, request: Any, prompt_token_ids: Sequence[int],
                    block_ids: list[list[int]], num_external_tokens: int,
                    state_block_ids: Sequence[Sequence[int]] = ()) -> None:
        """``update_state_after_alloc``: remember the request; when
        ``num_external_tokens > 0`` plan the load of those tokens into
        ``block_ids`` (per KV-cache group; -1: a null block, not loaded),
        and of each state group's state at their end into its block there
        (``state_block_ids``: per state group, positional: the block of the
        hit's last block)."""
        st = self._reqs.get(req_id)
        lk = self._lookups.pop(req_id, None)
        if st is None:
            hashes = lk.hashes if lk else []
            st = _ReqState(request, list(prompt_token_ids), hashes)
            st.stored_chunks = lk.hit_chunks if lk else 0
            self._reqs[req_id] = st
            self.stats.add(lookups=1, lookup_tokens=len(prompt_token_ids))
        st.block_ids = [list(ids) for ids in block_ids]
        if lk is not None and lk.decision is not None:
            self.stats.add(**{f"decisions_{lk.decision.kind.value}": 1})
        if num_external_tokens <= 0 or lk is None:
            return
        cs, bs = self.keys.chunk_size, self.keys.block_size
        end = lk.hit_tokens
        start = max(0, end - num_external_tokens)
        start -= start % bs
        first = start // cs
        last = (end - 1) // cs  # chunk holding the hit's last token
        bpc = self.keys.blocks_per_chunk
        held = min((len(ids) for ids in block_ids), default=0)
        need = min((last + 1) * bpc, held)
        if need < end // bs or len(block_ids) != len(self.cache_groups):
            log.warning("kvpool: request %s got %d blocks in %d groups for %d tokens; "
                        "not loading", req_id, held, len(block_ids), end)
            return
        # The last chunk may be partly beyond the allocated blocks: pad its ids
        # with -1 (never written: last_blocks stops before them).
        pad = [-1] * max(0, (last + 1) * bpc - need)
        groups = [list(ids[:need]) + pad for ids in block_ids]
        chunks = [ChunkRef(i, lk.hashes[i],
                           [b for ids in groups for b in ids[i * bpc : (i + 1) * bpc]],
                           lk.peers[i] if i < len(lk.peers) else "",
                           lk.splits[i] if i < len(lk.splits) else 0)
                  for i in range(first, last + 1)]
        skip = (start - first * cs) // bs
        tail = (end - last * cs) // bs
        d = lk.decision
        spec = LoadSpec(req_id, chunks, skip, self.cfg.load_async, 0 if tail == bpc else tail,
                        deadline_s=d.deadline_s if d is not None else 0.0,
                        predicted_s=d.predicted_load_s if d is not None else None,
                        located=self._first_group_located(lk, chunks))
        if self.state_groups:  # the state at the hit's end (a hit ends at a chunk's end)
            at = end // bs - 1
            tables = state_block_ids
            spec.states = [StateRef(s, last, lk.hashes[last], tables[s][at]
                                    if s < len(tables) and at < len(tables[s]) else -1)
                           for s in range(len(self.state_groups))]
        if d is not None and d.predicted_load_s is not None:
            self.stats.add(predicted_load_s=d.predicted_load_s)
        self._loads.append(spec)
        self._load_blocks[req_id] = {b for c in chunks for b in c.block_ids if b >= 0}
        if self.cfg.load_async:
            self._async_loading.add(req_id)
        self.stats.add(hit_tokens=end - start)

    def _first_group_located(self, lk: Lookup, chunks: list[ChunkRef]) -> Any:
        """The lookup's answers for the first layer group's objects of
        ``chunks`` (what the worker's load waits for first), or None."""
        if not lk.located:
            return None
        lr = self.layer_ranges[0][0]
        cg = (0, len(self.cache_groups))
        keys = [self.keys.object_key(c.hash, lr, hr, self.num_heads, cg) for c in chunks
                for hr in head_ranges(self.num_heads, c.head_objects or self.splits[0])]
        merged = Located.merge(lk.located)
        return merged.subset(keys) if merged is not None else None

    # ------------------------------------------------------------ per step

    def build_meta(self, step: StepInfo) -> ConnectorMeta:
        """``build_connector_meta``: this step's loads (from :meth:`after_alloc`)
        and saves (chunks complete after this step, not stored yet).

        Sliding-window blocks: vLLM frees a group's blocks once they fall out of
        its window (before this step: those of the tokens computed before it)
        and may hand them to any request. A save never reads a block freed by
        this step's allocation (:meth:`_plan_save` drops it), and when this
        step allocates a block that an earlier step's save reads, the workers
        finish their pending saves before the forward (``flush_saves``)."""
        meta = ConnectorMeta(loads=self._loads, preempted_req_ids=sorted(step.preempted_req_ids),
                             scheduled_tokens=sum(step.num_scheduled_tokens.values()))
        self._loads = []
        scheduled: list[tuple[_ReqState, str, int, int]] = []
        allocated: set[int] = set()
        for nr in step.new:
            st = self._reqs.get(nr.req_id)
            if st is None:
                prompt = list(nr.prompt_token_ids or [])
                st = self._reqs[nr.req_id] = _ReqState(None, prompt, [])
            st.block_ids = [list(ids) for ids in nr.block_ids]
            allocated.update(b for ids in nr.block_ids for b in ids)
            done = nr.num_computed_tokens + step.num_scheduled_tokens.get(nr.req_id, 0)
            scheduled.append((st, nr.req_id, nr.num_computed_tokens, done))
        for cr in step.cached:
            if cr.new_block_ids:
                allocated.update(b for ids in cr.new_block_ids for b in ids)
            st = self._reqs.get(cr.req_id)
            if st is None:
                continue
            if cr.resumed and cr.new_block_ids is not None:
                st.block_ids = [list(ids) for ids in cr.new_block_ids]
            elif cr.new_block_ids:
                if not st.block_ids:
                    st.block_ids = [[] for _ in cr.new_block_ids]
                for mine, new in zip(st.block_ids, cr.new_block_ids, strict=True):
                    mine.extend(new)
            done = cr.num_computed_tokens + step.num_scheduled_tokens.get(cr.req_id, 0)
            scheduled.append((st, cr.req_id, cr.num_computed_tokens, done))
        if self._sw_saving & allocated:
            meta.flush_saves = True
            self._sw_saving.clear()
        for st, req_id, before, done in scheduled:
            spec = self._plan_save(st, req_id, before, done)
            if spec is not None:
                meta.saves.append(spec)
        if step.state_offloads and self.save_enabled and self.state_groups:
            self._plan_state_saves(step.state_offloads, meta)
        for r in step.finished_req_ids:
            self._reqs.pop(r, None)
            self._lookups.pop(r, None)
            self._load_blocks.pop(r, None)
            self._no_load.discard(r)
        return meta

    def _plan_state_saves(self, offloads: dict[str, list[tuple[int, int, int]]],
                          meta: ConnectorMeta) -> None:
        """Save the recurrent states vLLM checkpointed this step at a chunk's
        end within the saved tokens (the prompt, or every token with
        ``save_decode``), beside the request's chunks; pin their blocks."""
        cs = self.keys.chunk_size
        specs = {s.req_id: s for s in meta.saves}
        for req_id, entries in offloads.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            tokens: Sequence[int] = st.prompt
            if self.cfg.save_decode and st.request is not None:
                tokens = st.request.all_token_ids
            refs: list[StateRef] = []
            for s, block_id, boundary in entries:
                if not (0 <= s < len(self.state_groups) and block_id >= 0 and boundary > 0
                        and boundary % cs == 0 and boundary <= len(tokens)):
                    continue  # not at a chunk's end (no hit can resume there)
                i = boundary // cs - 1
                if len(st.hashes) <= i:
                    st.hashes = self.keys.extend_hashes(st.hashes, list(tokens[: (i + 1) * cs]))
                pin = next(self._pin_ids)
                self._pin_waits[pin] = (block_id, self.state_ranks)
                refs.append(StateRef(s, i, st.hashes[i], block_id, pin))
            if not refs:
                continue
            if self.pins is not None:
                self.pins.pin([r.block_id for r in refs])
            self._pinned.setdefault(req_id, []).extend(r.pin for r in refs)
            spec = specs.get(req_id)
            if spec is None:
                spec = specs[req_id] = SaveSpec(req_id, [])
                meta.saves.append(spec)
            spec.states.extend(refs)
            st.had_saves = True

    def saves_done(self, req_ids: set[str] | None) -> None:
        """``update_connector_output``: finished requests whose saves the
        workers completed (``finished_sending``): unpin their state blocks
        (those no worker report released yet)."""
        for r in req_ids or ():
            self._unpin(r)

    def _unpin(self, req_id: str) -> None:
        blocks = [self._pin_waits.pop(p)[0] for p in self._pinned.pop(req_id, ())
                  if p in self._pin_waits]
        if blocks and self.pins is not None:
            self.pins.unpin(blocks)

    def _states_saved(self, pins: list[int]) -> None:
        """Workers finished these state saves: a block goes once every rank did
        (a pin already released with its request is ignored)."""
        done: list[int] = []
        for p in pins:
            wait = self._pin_waits.get(p)
            if wait is None:
                continue
            block, left = wait
            if left > 1:
                self._pin_waits[p] = (block, left - 1)
                continue
            del self._pin_waits[p]
            done.append(block)
        if done and self.pins is not None:
            self.pins.unpin(done)

    def _plan_save(self, st: _ReqState, req_id: str, before: int,
                   computed: int) -> SaveSpec | None:
        """The chunks complete once ``computed`` tokens are, not stored yet;
        a sliding-window group's blocks that vLLM freed before this step
        (outside the window of the ``before`` tokens computed earlier) are -1,
        not saved."""
        if not self.save_enabled or not st.block_ids:
            return None
        cs = self.keys.chunk_size
        tokens: Sequence[int] = st.prompt
        if self.cfg.save_decode and st.request is not None:
            tokens = st.request.all_token_ids
        limit = min(computed, len(tokens))
        bpc = self.keys.blocks_per_chunk
        n = min(limit // cs, min(len(ids) for ids in st.block_ids) // bpc)
        if n <= st.stored_chunks:
            return None
        if len(st.hashes) < n:
            st.hashes = self.keys.extend_hashes(st.hashes, list(tokens[: n * cs]))
        bs = self.keys.block_size
        gone = [first_window_block(before, g.window, bs) for g in self.cache_groups]
        chunks: list[ChunkRef] = []
        for i in range(st.stored_chunks, n):
            ids = [b if j >= gone[c] else -1
                   for c, group in enumerate(st.block_ids)
                   for j, b in enumerate(group[i * bpc : (i + 1) * bpc], i * bpc)]
            if any(b >= 0 for b in ids):
                chunks.append(ChunkRef(i, st.hashes[i], ids))
                for c, g in enumerate(self.cache_groups):
                    if g.window is not None:
                        self._sw_saving.update(b for b in ids[c * bpc : (c + 1) * bpc] if b >= 0)
        block_hashes = getattr(st.request, "block_hashes", None) if st.request else None
        if block_hashes:
            for ref in chunks:
                self._event_stored(ref.hash, ref.index, tokens, block_hashes, Medium.DRAM)
        st.stored_chunks = n
        st.had_saves = True
        return SaveSpec(req_id, chunks)

    def loads_done(self, req_ids: set[str] | None) -> None:
        """``update_connector_output``: async loads the workers reported finished."""
        self._async_loading -= set(req_ids or ())

    def loads_failed(self, block_ids: set[int] | None) -> set[str]:
        """``update_connector_output``: blocks the workers could not load (vLLM
        recomputes them). Their requests are never offered a load again (an
        async load that failed would otherwise be looked up and tried again).
        Returns those request ids."""
        if not block_ids:
            return set()
        hit = {r for r, blocks in self._load_blocks.items() if blocks & block_ids}
        for r in hit:
            self._no_load.add(r)
            del self._load_blocks[r]
        return hit

    def requests_failed(self, req_ids: set[str] | None) -> None:
        """``update_connector_output``: requests whose (async) load failed as a
        whole (``failed_recving``: models with several KV-cache groups, whose
        block ids do not name a request). vLLM computes them from the start;
        they are never offered a load again."""
        for r in req_ids or ():
            self._no_load.add(r)
            self._load_blocks.pop(r, None)

    def finished(self, req_id: str) -> bool:
        """``request_finished``: True when vLLM must keep the request's blocks:
        saves were queued (freed when the worker reports them done), or an
        async load is still writing into them (aborted while waiting for KV;
        freed when the load is reported)."""
        st = self._reqs.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._load_blocks.pop(req_id, None)
        self._no_load.discard(req_id)
        had_saves = bool(st and st.had_saves)
        if not had_saves:  # no save will report it: release now
            self._unpin(req_id)
        return had_saves or req_id in self._async_loading

#!/usr/bin/env python3
"""GPU check of the vLLM connector's worker side (run by scripts/gpu_check.py).

Without vLLM: allocates paged KV caches in vLLM's CUDA layout (one bf16
backing allocation, LBNHC: per layer ``[num_blocks, block, kv_heads,
2*head]`` physical, viewed ``[num_blocks, kv_heads, block, 2*head]``), for
Llama-3.1-8B's geometry (32 layers, 8 KV heads of 128), and a ``kvpool
client`` node daemon on this machine. Two parts:

1. Throughput (``cases``): save chunks through
   :class:`kvpool.connector.worker.KVPoolWorker` and load them into other
   blocks (consecutive and scattered); one object per (chunk, layer group),
   gathered on the GPU into a staging tensor and moved with one cudaMemcpy per
   object; GB/s next to pinned cudaMemcpy measured in the same run. Bytes
   verified on the GPU. Swept over ``--layer-groups`` (the object layout).
2. Layer-wise pipelining (``pipeline``): a request whose ``--hit-tokens`` are
   loaded while the GPU computes a step of ``--compute-tokens`` new tokens
   with a per-layer compute stand-in sized like a Llama-3.1-8B decoder layer
   (QKV/O projections, SDPA over the context, gated MLP 14336; bf16). The
   harness's time to first token is the time from ``start_load_kv`` to the
   last layer's compute done:
   - ``ttft_serial_s``: loads complete before the forward (layerwise off);
   - ``ttft_pipelined_s``: every group's load starts at once, each layer
     waits only for its group (``wait_for_layer_load``) and computes; as in
     vLLM, whose attention op calls ``wait_for_layer_load``, a layer waits
     after its QKV projection (``--wait-at attention``; ``layer``: before
     it); each step's load comes from the scheduler-side calls vLLM makes
     (lookup, ``update_state_after_alloc``, ``build_connector_meta``) right
     before it (``--pipeline-lookup``), and the garbage collector's heap is
     frozen after set-up as vLLM's engine core does (``--no-gc-freeze``);
   - ``load_s`` (load alone), ``compute_s`` (forward alone);
   - ``hidden_fraction = (ttft_serial - ttft_pipelined) / load_s``: the part
     of the load time hidden behind compute (goal >= 0.8; at most
     ``1 - 1/groups``: the first group's load has nothing to hide behind).
   - ``hidden_vs_arrived = 1 - (ttft_pipelined - forward_after_arrival) /
     load_s``: the same against a forward whose data had all arrived before
     it started (same scatters on its path): what remains is the wait for
     the first group and the forward's slowdown while DMAs run beside it.
   Loaded bytes are verified after the pipelined run; ``group_arrival_ms``:
   when each layer group of the last pipelined run had arrived (ms after
   ``start_load_kv``); ``forward_after_arrival_s``: a layer-wise forward
   started once every group had arrived (its excess over ``compute_s`` is
   the scatters' cost on the forward's path, without any overlap).

Standalone: ``python scripts/gpu_check_connector.py [--json OUT]
[--layer-groups 1 4 8 16] [--hit-tokens 4096] [--compute-tokens 2048 256]``
(``--device cpu``: a dry run without a GPU, tiny sizes).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
from functools import partial
from itertools import pairwise
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.metadata import ChunkRef, LoadSpec, SaveSpec
from kvpool.connector.scheduler import KVPoolScheduler, NewReq, StepInfo
from kvpool.connector.store_access import StoreAccess
from kvpool.connector.worker import HeadSpec, KVPoolWorker

DEFAULTS: dict[str, Any] = dict(layers=32, blocks=2048, block=16, heads=8, head=128,
                                chunk_tokens=(256, 1024), stored_gib=1.0, device="cuda",
                                staging_mib=(512,), repeat=2, layer_groups=(1, 4, 8, 16),
                                hit_tokens=4096, compute_tokens=(2048, 256), q_heads=32,
                                hidden=4096, mlp=14336, pipeline_groups=(4, 8, 16),
                                pipeline_layouts=("short-first",),
                                pipeline_locate=("split",), pipeline_words=(16,),
                                pipeline_handoff=("scatter",), pipeline_first_copy=("ahead",),
                                pipeline_lookup=("scheduler",), idle_ms=100.0,
                                wait_at="attention", gc_freeze=True)

#: read lease of the check's master (s): the rounds wait it out after emptying the store
LEASE_S = 0.5


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _Trace:
    """Timeline of one load: (what, thread, start ms, end ms) of the load
    pipeline's and the store's steps, from ``start_load_kv``. Wraps methods
    of the classes while on (this check's instrumentation, not the product's)."""

    STEPS = (("kvpool.connector.load", "LoadPipeline",
              ("start", "plan", "fetch", "_prepare_scatter", "finish_group", "_scatter")),
             ("kvpool.store.pipelined", "Pipelined", ("read",)),
             ("kvpool.store.session", "MasterSession", ("locate",)),
             ("kvpool.store.reads", "Reads", ("locations", "read")),
             ("kvpool.core.rpc_client", "MasterClient", ("call",)),
             ("kvpool.connector.layout", "ObjectLayout",
              ("scatter", "prepare_scatter", "_run_view", "_index")),
             ("kvpool.transfer.runner", "BatchRunner", ("run",)))

    def __init__(self) -> None:
        import importlib
        import threading

        self.on = False
        self.t0 = 0.0
        self.rows: list[list[Any]] = []
        for mod, cls_name, names in self.STEPS:
            cls = getattr(importlib.import_module(mod), cls_name)
            for name in names:
                setattr(cls, name, self._wrap(getattr(cls, name), f"{cls_name}.{name}",
                                              threading.current_thread))

    def _wrap(self, fn: Any, label: str, current: Any) -> Any:
        def traced(*args: Any, **kw: Any) -> Any:
            if not self.on:
                return fn(*args, **kw)
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.rows.append([label, current().name, round(1000 * (t - self.t0), 3),
                                  round(1000 * (time.perf_counter() - self.t0), 3)])
        return traced

    def begin(self, t0: float) -> None:
        self.rows, self.t0, self.on = [], t0, True

    def end(self) -> list[list[Any]]:
        self.on = False
        return sorted(self.rows, key=lambda r: r[2])


def _even_layer_ranges(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """Layer groups of equal size (the layout before the short first group)."""
    g = max(1, min(groups, num_layers))
    return [(i * num_layers // g, (i + 1) * num_layers // g) for i in range(g)]


def _pinned(torch: Any, nbytes: int, piece: int, iters: int = 3,
            device: str = "cuda") -> dict[str, float]:
    """Pinned cudaMemcpy GB/s (H2D, D2H) moving ``nbytes`` in ``piece``-byte copies
    (device "cpu": plain memcpy, for a dry run without a GPU)."""
    n = max(1, nbytes // piece)
    host = torch.empty(n * piece, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(n * piece, dtype=torch.uint8, device=device)
    out = {}
    for name in ("h2d", "d2h"):
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(iters):
            for i in range(n):
                s = slice(i * piece, (i + 1) * piece)
                if name == "h2d":
                    dev[s].copy_(host[s])
                else:
                    host[s].copy_(dev[s])
            _sync(torch, device)
        out[name] = n * piece * iters / (time.perf_counter() - t0) / 1e9
    del host, dev
    return out


def _check_one(torch: Any, w: KVPoolWorker, kv: Any, chunk_tokens: int, block: int,
               n_chunks: int, scattered: bool, seed: int, device: str,
               repeat: int = 1) -> dict[str, Any]:
    """Save ``n_chunks`` chunks and load them into other blocks ``repeat`` times
    (the store emptied in between); GB/s of the best round, every round listed."""
    rounds = []
    for i in range(repeat):
        rounds.append(_round(torch, w, kv, chunk_tokens, block, n_chunks, scattered,
                             seed + 1000 * i, device))
        w.store.call(lambda c: c.remove_all(force=True))
        # the removed chunks' space is held until the loads' leases end (master/removal.py)
        time.sleep(LEASE_S + 0.1)
    best = dict(rounds[0])
    best["save_GBps"] = max(r["save_GBps"] for r in rounds)
    best["load_GBps"] = max(r["load_GBps"] for r in rounds)
    best["bytes_equal"] = all(r["bytes_equal"] for r in rounds)
    best["failed_blocks"] = sum(r["failed_blocks"] for r in rounds)
    best["rounds"] = [{k: round(r[k], 4) for k in ("save_GBps", "load_GBps", "save_s",
                                                  "save_store_s", "load_s", "load_store_s")}
                      for r in rounds]
    return best


def _round(torch: Any, w: KVPoolWorker, kv: Any, chunk_tokens: int, block: int,
           n_chunks: int, scattered: bool, seed: int, device: str) -> dict[str, Any]:
    bpc = chunk_tokens // block
    nb = kv.shape[1]
    need = n_chunks * bpc
    g = torch.Generator().manual_seed(seed)
    if scattered:
        perm = torch.randperm(nb, generator=g).tolist()
        src_ids, dst_ids = perm[:need], perm[need : 2 * need]
    else:
        src_ids, dst_ids = list(range(need)), list(range(need, 2 * need))
    toks = torch.randint(0, 50000, (n_chunks * chunk_tokens,), generator=g).tolist()
    hashes = w.keys.chunk_hashes(toks)
    src = [ChunkRef(i, h, src_ids[i * bpc : (i + 1) * bpc]) for i, h in enumerate(hashes)]
    dst = [ChunkRef(i, h, dst_ids[i * bpc : (i + 1) * bpc]) for i, h in enumerate(hashes)]
    nbytes = n_chunks * w.chunk_bytes
    # time spent inside store calls (RPCs + copies); the rest is gather/scatter
    store_s = [0.0]
    calls = [0]
    orig = w.store.call

    def timed(fn: Any) -> Any:
        t = time.perf_counter()
        try:
            return orig(fn)
        finally:
            store_s[0] += time.perf_counter() - t
            calls[0] += 1

    w.store.call = timed  # type: ignore[method-assign]
    try:
        _sync(torch, device)
        t0 = time.perf_counter()
        written = w.save([SaveSpec("gpu-check", src)])
        t_save = time.perf_counter() - t0
        save_store_s, save_calls = store_s[0], calls[0]
        store_s[0], calls[0] = 0.0, 0
        t0 = time.perf_counter()
        res = w.load(LoadSpec("gpu-check", dst))
        _sync(torch, device)
        t_load = time.perf_counter() - t0
    finally:
        w.store.call = orig  # type: ignore[method-assign]
    s_idx = torch.tensor(src_ids, device=device)
    d_idx = torch.tensor(dst_ids, device=device)
    ok = bool(torch.equal(kv.index_select(1, s_idx), kv.index_select(1, d_idx)))
    return {
        "chunk_tokens": chunk_tokens, "chunks": n_chunks, "scattered": scattered,
        "bytes": nbytes, "object_bytes": w.chunk_bytes,
        "written_chunks": written, "loaded_chunks": res.loaded_chunks,
        "failed_blocks": len(res.failed_block_ids), "bytes_equal": ok,
        "save_GBps": nbytes / t_save / 1e9, "load_GBps": nbytes / t_load / 1e9,
        "save_s": t_save, "save_store_s": save_store_s, "save_store_calls": save_calls,
        "load_s": t_load, "load_store_s": store_s[0], "load_store_calls": calls[0],
    }


class _LayerStandIn:
    """One decoder layer's GPU work for ``tokens`` new tokens over ``ctx``
    tokens of context, sized like Llama-3.1-8B (hidden 4096, 32 query heads,
    8 KV heads of 128, gated MLP 14336; bf16): QKV and O projections, SDPA,
    gate/up and down projections. Weights are shared by all layers (same
    FLOPs; the KV cache is what the connector moves)."""

    def __init__(self, torch: Any, device: str, tokens: int, ctx: int, p: dict[str, Any]) -> None:
        hd, qh, kvh = p["head"], p["q_heads"], p["heads"]
        d, m = p["hidden"], p["mlp"]
        dt = torch.bfloat16
        g = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape: int) -> Any:
            return torch.randn(*shape, generator=g, device=device, dtype=dt) * 0.02

        self.torch = torch
        self.x = rnd(tokens, d)
        self.wqkv, self.wo = rnd(d, (qh + 2 * kvh) * hd), rnd(qh * hd, d)
        self.wgu, self.wd = rnd(d, 2 * m), rnd(m, d)
        self.k = rnd(1, qh, ctx, hd)  # context K/V (GQA expanded)
        self.v = rnd(1, qh, ctx, hd)
        self.qh, self.hd, self.m, self.tokens = qh, hd, m, tokens

    def __call__(self) -> None:
        self.post(self.pre())

    def pre(self) -> Any:
        """The layer's work before attention (the QKV projection): vLLM runs it
        before ``wait_for_layer_load``, which its attention op calls first."""
        qkv = self.x @ self.wqkv
        return qkv[:, : self.qh * self.hd].reshape(1, self.tokens, self.qh, self.hd) \
            .transpose(1, 2)

    def post(self, q: Any) -> None:
        """Attention over the context, the O projection and the MLP."""
        t = self.torch
        kv_len = self.k.shape[2]
        o = t.nn.functional.scaled_dot_product_attention(
            q, self.k[:, :, :kv_len], self.v[:, :, :kv_len])
        h = o.transpose(1, 2).reshape(self.tokens, -1) @ self.wo
        gu = h @ self.wgu
        a = t.nn.functional.silu(gu[:, : self.m]) * gu[:, self.m :]
        self.out = a @ self.wd


def _forward(torch: Any, device: str, w: KVPoolWorker, meta: Any, layer: Any, kv: Any,
             dst_ids: list[int], names: list[str], layerwise: bool, compute: bool,
             load: bool, arrived_first: bool = False, trace: _Trace | None = None,
             layer_ms: list[float] | None = None, idle_s: float = 0.0,
             wait_at: str = "attention") -> float:
    """One harness forward: start_load_kv, per layer wait_for_layer_load then the
    layer's compute, wait_for_save; seconds until the GPU is done
    (``arrived_first``: timed from when every layer group had arrived).
    ``layer_ms``: filled with each layer's GPU milliseconds (CUDA events; the
    first from the forward's start); ``idle_s``: the GPU left idle this long
    before the forward starts. ``wait_at``: where in a layer the forward
    waits for its KV (see below). ``meta``: the step's metadata, or a function
    making it (the scheduler's lookup, right before the step, as in vLLM)."""
    w.layerwise = layerwise
    kv[:, dst_ids].zero_()
    _sync(torch, device)
    if idle_s:
        time.sleep(idle_s)
    if load and callable(meta):
        meta = meta()
    events = [] if layer_ms is not None and device == "cuda" else None
    t0 = time.perf_counter()
    if trace is not None:
        trace.begin(t0)
    if load:
        w.start_load(meta)
        job = w.loads._active
        if arrived_first and job is not None:
            for ev in job.arrived:
                ev.wait(30.0)
            t0 = time.perf_counter()
    if events is not None:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    for name in names:
        # vLLM waits for a layer's KV in its attention op, after the layer's
        # QKV projection (``wait_at="attention"``); "layer": before all of it
        q = layer.pre() if compute and wait_at == "attention" else None
        if load:
            w.wait_for_layer(name)
        if compute:
            layer.post(q if q is not None else layer.pre())
        if events is not None:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
    if load:
        w.end_step(None)
    _sync(torch, device)
    dt = time.perf_counter() - t0
    if events is not None and layer_ms is not None:
        layer_ms[:] = [round(a.elapsed_time(b), 3) for a, b in pairwise(events)]
    if trace is not None:
        trace.rows = trace.end()
    if load and w.take_load_errors():
        raise RuntimeError("pipelined load failed")
    return dt


_STEP = itertools.count()


class _GcPauses:
    """The interpreter's garbage-collection pauses while active (ms, with the
    generation): a stall in one timed run is told apart from the load's own."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((int(info.get("generation", -1)),
                                round(1000 * (time.perf_counter() - self._t0), 3)))

    def __enter__(self) -> _GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _scheduled_meta(sched: KVPoolScheduler, prompt: list[int], block_ids: list[int]) -> Any:
    """One request's step as vLLM's scheduler makes it: the prefix lookup
    (``get_num_new_matched_tokens``), ``update_state_after_alloc`` with its
    blocks, ``build_connector_meta``; the request is finished at once."""
    rid = f"pipe-{next(_STEP)}"
    hit, _ = sched.lookup(rid, prompt, 0)
    if hit <= 0:
        raise RuntimeError("the scheduler's lookup found nothing to load")
    sched.after_alloc(rid, None, prompt, [block_ids], hit)
    meta = sched.build_meta(StepInfo(new=[NewReq(rid, [block_ids], 0)],
                                     num_scheduled_tokens={rid: len(prompt) - hit}))
    sched.build_meta(StepInfo(finished_req_ids={rid}))
    return meta


def _scatter_probe(torch: Any, w: KVPoolWorker, dst_ids: list[int], bpc: int,
                   n_chunks: int, iters: int = 10) -> dict[str, float]:
    """GPU ms of one scatter of every chunk for the largest layer group, from
    a staging tensor into consecutive blocks (strided copy) and into the same
    blocks in shuffled order (indexed copy), at the layout's copy word."""
    geo = w.geo
    assert geo is not None and geo.objects is not None
    ol = geo.objects
    g = max(range(len(geo.groups)), key=lambda i: len(geo.groups[i]))
    sel, heads = geo.groups[g], geo.heads.count
    nbytes = n_chunks * ol.object_bytes(sel, heads)
    staging = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    run = [dst_ids[i * bpc : (i + 1) * bpc] for i in range(n_chunks)]
    mixed = [list(reversed(c)) for c in reversed(run)]
    out: dict[str, float] = {"layers": len(sel), "mib": nbytes / (1 << 20)}
    for name, ids in (("strided_ms", run), ("indexed_ms", mixed)):
        ol.scatter(ids, sel, 0, heads, staging)  # warm
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(iters):
            ol.scatter(ids, sel, 0, heads, staging)
        b.record()
        b.synchronize()
        out[name] = round(a.elapsed_time(b) / iters, 4)
    return out


def _pipeline(torch: Any, address: str, kv: Any, caches: dict[str, Any], p: dict[str, Any],
              device: str) -> list[dict[str, Any]]:
    """Layer-wise pipelining: TTFT with and without it (see the module docstring)."""
    from kvpool.connector.metadata import ConnectorMeta

    L, N, H = p["layers"], p["block"], p["heads"]
    ct = 256
    n_chunks = max(1, p["hit_tokens"] // ct)
    bpc = ct // N
    nb = kv.shape[1]
    src_ids = list(range(n_chunks * bpc))
    dst_ids = list(range(nb - n_chunks * bpc, nb))
    names = list(caches)
    out = []
    trace = _Trace() if device == "cuda" else None
    import kvpool.connector.geometry as geometry

    ramped = geometry.layer_ranges
    import kvpool.connector.load as load_mod

    handoff_max = load_mod.HANDOFF_MAX_S
    for groups, layout, locate, word, handoff, first_copy, lookup in [
            (g, lay, loc, wd, ho, fc, lk) for g in p["pipeline_groups"]
            for lay in p["pipeline_layouts"] for loc in p["pipeline_locate"]
            for wd in p["pipeline_words"] for ho in p["pipeline_handoff"]
            for fc in p["pipeline_first_copy"] for lk in p["pipeline_lookup"]]:
        # "ahead": the first group's copy made before its data arrives
        load_mod.FIRST_COPY_AHEAD = first_copy == "ahead"
        # "scatter": after the first group arrived the fetch thread waits until the
        # forward launched its scatter; "fixed": a fixed pause instead
        load_mod.HANDOFF_MAX_S = handoff_max if handoff == "scatter" else 0.0
        # "even": the same run with equal layer groups, for comparison
        geometry.layer_ranges = ramped if layout == "short-first" else _even_layer_ranges
        ks = KeySpace(f"gpu-pipe-g{groups}-{layout}-{locate}-w{word}-{handoff}-{first_copy}"
                      f"-{lookup}", "bfloat16", N, ct)
        # "split": part 0's keys located first, the rest's while it moves; "one": one RPC
        cfg = ConnectorConfig(master_address=address, chunk_size=ct, layer_groups=groups,
                              load_or_recompute=False, load_timeout_s=30.0,
                              client_overrides={"split_first_locate": locate == "split"})
        w = KVPoolWorker(cfg, ks, StoreAccess(cfg), heads=HeadSpec(0, H, H, True))
        w.register_kv_caches(caches)
        objects = w.geo.objects if w.geo else None
        if objects is not None:  # "words": the copy word of gathers and scatters, compared
            objects._word = min(word, objects._word)
        arrivals: dict[str, list[float]] = {}
        close_job = w.loads.close_job

        def closing(job: Any, close: Any = close_job, seen: Any = arrivals) -> Any:
            seen["ms"] = [round(1000 * job.part_s[g], 2) for g in sorted(job.part_s)]
            return close(job)

        w.loads.close_job = closing  # type: ignore[method-assign]
        toks = torch.randint(0, 50000, (n_chunks * ct,), generator=torch.Generator()
                             .manual_seed(groups)).tolist()
        hashes = ks.chunk_hashes(toks)
        w.save([SaveSpec("pipe", [ChunkRef(i, h, src_ids[i * bpc : (i + 1) * bpc])
                                  for i, h in enumerate(hashes)])])
        meta: Any = ConnectorMeta(loads=[LoadSpec("pipe", [
            ChunkRef(i, h, dst_ids[i * bpc : (i + 1) * bpc]) for i, h in enumerate(hashes)])])
        sched = None
        if lookup == "scheduler":
            # "scheduler": every forward's load comes from vLLM's scheduler-side
            # calls (lookup, after_alloc, build_meta) made right before it, so
            # the worker gets the lookup's answers for the first group
            # (LoadSpec.located); "none": the load spec made by hand, located
            # by the worker alone
            sched = KVPoolScheduler(cfg, ks, L, StoreAccess(cfg), save=False, num_heads=H)
            meta = partial(_scheduled_meta, sched, [*toks, 0], dst_ids)
        scatter_probe = _scatter_probe(torch, w, dst_ids, bpc, n_chunks) if device == "cuda" \
            else {}
        for tokens in p["compute_tokens"]:
            layer = _LayerStandIn(torch, device, tokens, n_chunks * ct + tokens, p)
            for _ in range(3):  # warm the kernels
                layer()
            _sync(torch, device)

            run_ = partial(_forward, torch, device, w, meta, layer, kv, dst_ids, names,
                           wait_at=p["wait_at"])
            if p["gc_freeze"]:  # as vLLM's engine core does after start-up (freeze_gc_heap)
                gc.collect()
                gc.freeze()

            # rounds of every mode back to back: the GPU's speed drifts by several
            # per cent between runs (clocks), so modes are compared within a round
            modes = {"compute": dict(layerwise=False, load=False),
                     "load": dict(layerwise=False, compute=False),
                     "serial": dict(layerwise=False),
                     "pipelined": dict(layerwise=True, trace=trace),
                     "after": dict(layerwise=True, arrived_first=True)}
            rounds: dict[str, list[float]] = {m: [] for m in modes}
            # and every run starts after the GPU idled ``idle_ms``: it clocks down
            # under back-to-back forwards (on the H200 a forward right after
            # another took ~10% longer), and a serial run's load leaves it idle
            # for its whole duration, which would favour that mode
            idle = p["idle_ms"] / 1000
            # GC pauses per run, so that a stalled run can be told apart
            slow_gc: dict[str, list[Any]] = {m: [] for m in modes}
            slowest: dict[str, Any] = {}
            for rnd in range(p["repeat"] + 1):
                for m, kw in modes.items():
                    with _GcPauses() as pauses:
                        rounds[m].append(run_(**{"compute": True, "load": True,
                                                 "idle_s": idle, **kw}))
                    if any(ms >= 1.0 for _g, ms in pauses.pauses):
                        slow_gc[m].append([rnd, pauses.pauses])
                    if m == "pipelined" and trace is not None and \
                            rounds[m][-1] >= max(rounds[m]):  # the slowest one's steps
                        slowest = {"round": rnd, "ms": round(1000 * rounds[m][-1], 2),
                                   "group_arrival_ms": arrivals.get("ms", []),
                                   "timeline_ms": trace.rows}
            compute_s, load_s, serial_s, pipe_s, after_s = (
                min(rounds[m]) for m in ("compute", "load", "serial", "pipelined", "after"))
            timeline = trace.rows if trace is not None else []
            per_round = sorted((s_ - p_) / ld for s_, p_, ld in
                               zip(rounds["serial"], rounds["pipelined"], rounds["load"],
                                   strict=True) if ld)
            # one more run of each, GPU ms per layer (where a forward is slower)
            layer_ms: dict[str, list[float]] = {}
            for label, kw in (("compute", dict(layerwise=False, compute=True, load=False)),
                              ("compute_back_to_back", dict(layerwise=False, compute=True,
                                                            load=False, idle_s=0.0)),
                              ("pipelined", dict(layerwise=True, compute=True, load=True)),
                              ("after_arrival", dict(layerwise=True, compute=True, load=True,
                                                     arrived_first=True))):
                got: list[float] = []
                run_(**{"idle_s": idle, **kw}, layer_ms=got)
                layer_ms[label] = got
            part_ms = arrivals.get("ms", [])  # the last pipelined run's groups
            ok = bool(torch.equal(kv[:, src_ids], kv[:, dst_ids]))
            per_layer_ms = 1000 * compute_s / L
            sizes = [b - a for a, b in w.geo.group_keys] if w.geo else []
            r = {"layer_groups": groups, "group_layers": sizes, "layout": layout,
                 "locate": locate, "lookup": lookup, "wait_at": p["wait_at"],
                 "gc_frozen": p["gc_freeze"], "handoff": handoff, "first_copy": first_copy,
                 "copy_word": objects._word if objects else None,
                 "scatter_probe": scatter_probe,
                 "hit_tokens": n_chunks * ct, "compute_tokens": tokens,
                 "stand_in": "Llama-3.1-8B decoder layer (hidden 4096, 32 q / 8 kv heads of "
                             "128, MLP 14336, bf16)",
                 "stand_in_ms_per_layer": per_layer_ms, "loaded_bytes": n_chunks * w.chunk_bytes,
                 "load_s": load_s, "compute_s": compute_s, "ttft_serial_s": serial_s,
                 "ttft_pipelined_s": pipe_s,
                 "hidden_fraction": (serial_s - pipe_s) / load_s if load_s else None,
                 # the same within each round (serial, pipelined and load of one round)
                 "hidden_fraction_rounds": {
                     "median": per_round[len(per_round) // 2] if per_round else None,
                     "min": per_round[0] if per_round else None,
                     "max": per_round[-1] if per_round else None, "n": len(per_round)},
                 "rounds_s": rounds, "idle_ms_before_each_run": p["idle_ms"],
                 "gc_pauses_over_1ms": slow_gc, "slowest_pipelined": slowest,
                 "hidden_bound": 1 - sizes[0] / L if sizes else None, "bytes_equal": ok,
                 "group_arrival_ms": part_ms, "timeline_ms": timeline,
                 "layer_gpu_ms": layer_ms,
                 "layer_gpu_ms_sum": {k: round(sum(v), 3) for k, v in layer_ms.items()},
                 "forward_after_arrival_s": after_s,
                 # the load's time that still shows in the pipelined forward,
                 # against one whose data had all arrived (same scatters)
                 "exposed_vs_arrived_s": pipe_s - after_s,
                 "hidden_vs_arrived": 1 - (pipe_s - after_s) / load_s if load_s else None}
            out.append(r)
            print(f"pipeline groups={groups} ({layout} {sizes}, locate {locate}, lookup "
                  f"{lookup}, handoff "
                  f"{handoff}, first copy {first_copy}, word "
                  f"{r['copy_word']}, scatter {scatter_probe}) "
                  f"hit={n_chunks * ct} compute={tokens} tok "
                  f"({per_layer_ms:.2f} ms/layer): load {1000 * load_s:.1f} ms, compute "
                  f"{1000 * compute_s:.1f} ms, TTFT serial {1000 * serial_s:.1f} ms, pipelined "
                  f"{1000 * pipe_s:.1f} ms (after arrival {1000 * after_s:.1f} ms), hidden "
                  f"{r['hidden_fraction']:.2f} (per round: median "
                  f"{r['hidden_fraction_rounds']['median']:.2f}, "
                  f"{r['hidden_fraction_rounds']['min']:.2f}-"
                  f"{r['hidden_fraction_rounds']['max']:.2f}) "
                  f"(bound {r['hidden_bound']:.2f}), bytes_equal={ok}")
        w.store.call(lambda c: c.remove_all(force=True))
        time.sleep(LEASE_S + 0.1)  # (as in _throughput)
        w.close()
        w.store.close()
        if sched is not None:
            sched.store.close()
    geometry.layer_ranges = ramped
    load_mod.HANDOFF_MAX_S = handoff_max
    load_mod.FIRST_COPY_AHEAD = True
    return out


def _throughput(torch: Any, address: str, kv_bytes: Any, caches: dict[str, Any],
                p: dict[str, Any], res: dict[str, Any], device: str) -> None:
    """Save/load GB/s per chunk size, staging size and layer-group count."""
    L, N, H = p["layers"], p["block"], p["heads"]
    page = N * H * 2 * p["head"] * 2
    B = p["blocks"]
    store_bytes = int(p["stored_gib"] * (1 << 30))
    mibs = p["staging_mib"]
    mibs = [mibs] if isinstance(mibs, int | float) else list(mibs)
    for ct, mib, groups in [(ct, mib, g) for ct in p["chunk_tokens"] for mib in mibs
                            for g in p["layer_groups"]]:
        n_chunks = max(1, store_bytes // (L * page * (ct // N)))
        if 2 * n_chunks * (ct // N) > B:
            n_chunks = B // (2 * (ct // N))
        ks = KeySpace(f"gpu-check-g{groups}", "bfloat16", N, ct)
        cfg = ConnectorConfig(master_address=address, chunk_size=ct, staging_mib=mib,
                              layer_groups=groups, load_timeout_s=30.0)
        w = KVPoolWorker(cfg, ks, StoreAccess(cfg), heads=HeadSpec(0, H, H, True))
        w.register_kv_caches(caches)
        res.setdefault("warmup_s", []).append(w.warmup_s)
        try:
            for scattered in (False, True):
                r = _check_one(torch, w, kv_bytes, ct, N, n_chunks, scattered, ct,
                               device, p["repeat"])
                r["staging_mib"] = mib
                r["layer_groups"] = groups
                r["object_bytes"] = w.chunk_bytes // groups
                r["single_kernel_gather"] = bool(w.objects and w.objects.single_kernel)
                pin = _pinned(torch, r["bytes"], r["object_bytes"], device=device)
                r["pinned_GBps"] = pin
                r["save_vs_pinned_d2h"] = r["save_GBps"] / pin["d2h"]
                r["load_vs_pinned_h2d"] = r["load_GBps"] / pin["h2d"]
                res.setdefault("cases", []).append(r)
                print(f"connector chunk={ct} groups={groups} ({r['object_bytes'] >> 20} MiB "
                      f"objects) staging={mib}MiB scattered={scattered}: save "
                      f"{r['save_GBps']:.1f} GB/s ({r['save_vs_pinned_d2h']:.2f}x pinned D2H), "
                      f"load {r['load_GBps']:.1f} GB/s ({r['load_vs_pinned_h2d']:.2f}x pinned "
                      f"H2D), bytes_equal={r['bytes_equal']} rounds={r['rounds']}")
        finally:
            w.close()
            w.store.close()


def _state_round_trip(torch: Any, address: str, device: str) -> dict[str, Any]:
    """Recurrent (Mamba) states on the device: saved from the exact blocks of
    4 GDN-sized layers (int8 views of padded pages, as vLLM hands them over)
    straight through the store client's device path, and loaded into other
    blocks of other tensors; bytes compared."""
    from kvpool.connector.keys import KeySpace
    from kvpool.connector.metadata import StateRef
    from kvpool.connector.state import StateCache
    from kvpool.connector.store_access import StoreAccess

    nb, used, page = 64, 3 * 512 * 2 + 4 * 64 * 64 * 4, 81920  # Qwen3-Next-like test layer

    def layers(seed: int) -> list[tuple[str, Any]]:
        g = torch.Generator(device=device).manual_seed(seed)
        out = []
        for i in range(4):
            pages = torch.randint(-128, 127, (nb, page), generator=g, dtype=torch.int8,
                                  device=device)
            out.append((f"model.layers.{2 * i}.linear_attn",
                        pages[:, :used].view(nb, 1, 1, used)))
        return out

    cfg = ConnectorConfig(master_address=address, chunk_size=64)
    keys = KeySpace("gpu-check-state", "bfloat16", 64, 64)
    hashes = keys.chunk_hashes(list(range(64 * 3)))
    src, dst = layers(1), layers(2)
    store = StoreAccess(cfg)
    try:
        a = StateCache([src], keys, store)
        b = StateCache([dst], keys, store)
        refs = [StateRef(0, i, h, 5 + i) for i, h in enumerate(hashes)]
        _sync(torch, device)
        t0 = time.perf_counter()
        written = a.save(refs)
        t1 = time.perf_counter()
        ok, nbytes = b.load([StateRef(0, r.index, r.hash, 40 + r.index) for r in refs])
        _sync(torch, device)
        t2 = time.perf_counter()
        equal = ok and all(torch.equal(x[5 + i], y[40 + i]) for (_, x), (_, y)
                           in zip(src, dst, strict=True) for i in range(len(refs)))
    finally:
        store.close()
    out = {"states": len(refs), "layers": 4, "bytes": nbytes, "saved": written[0],
           "save_s": t1 - t0, "load_s": t2 - t1, "bytes_equal": bool(equal)}
    print(f"state round trip: {out}")
    return out


def run(report: dict[str, Any], **overrides: Any) -> None:
    """Record results under ``report["connector"]``; prints a summary line per case."""
    p = {**DEFAULTS, **overrides}
    res: dict[str, Any] = {"params": {k: v for k, v in p.items()}}
    report["connector"] = res
    try:
        import torch
    except ImportError as exc:
        res["skipped"] = f"torch unavailable: {exc}"
        return
    device = p["device"]
    if device == "cuda" and not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
        return
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    L, B, N, H, C = p["layers"], p["blocks"], p["block"], p["heads"], 2 * p["head"]
    # vLLM's CUDA default layout LBNHC: [L, B, N, H, C] physical.
    kv = torch.randn(L, B, N, H, C, dtype=torch.bfloat16, device=device)
    caches = {f"model.layers.{i}.self_attn.attn": kv[i].permute(0, 2, 1, 3) for i in range(L)}
    kv_bytes = kv.view(torch.uint8).view(L, B, -1)  # per layer, per block, opaque bytes
    store_bytes = int(p["stored_gib"] * (1 << 30))
    # remove_all(force=True) between rounds holds the space of read-leased chunks until
    # their leases end (master/removal.py): a short lease (every load here takes
    # milliseconds), waited out after each round, and one more round's room
    pool_bytes = int(store_bytes * 3.5) + (64 << 20)
    with MasterProcess(extra_args=["--lease-ttl-ms", str(int(LEASE_S * 1000))]) as m, \
            NodeDaemonProcess(m.address, memory=pool_bytes, start_timeout_s=120) as _d:
        if p["chunk_tokens"]:
            _throughput(torch, m.address, kv_bytes, caches, p, res, device)
        if p["pipeline_groups"]:
            res["pipeline"] = _pipeline(torch, m.address, kv, caches, p, device)
        res["state"] = _state_round_trip(torch, m.address, device)
    big = _pinned(torch, min(1 << 30, 4 * store_bytes), 64 << 20, device=device)
    res["pinned_64MiB_GBps"] = big
    cases = res.get("cases", [])
    pipe = res.get("pipeline", [])
    res["all_bytes_equal"] = (all(c["bytes_equal"] and not c["failed_blocks"] for c in cases)
                              and all(r["bytes_equal"] for r in pipe)
                              and res["state"]["bytes_equal"])
    best = max(cases, key=lambda c: min(c["save_GBps"], c["load_GBps"]), default=None)
    if best:
        res["best_vs_pinned"] = {"save": best["save_GBps"] / big["d2h"],
                                 "load": best["load_GBps"] / big["h2d"],
                                 "chunk_tokens": best["chunk_tokens"],
                                 "layer_groups": best["layer_groups"]}
    if pipe:
        top = max(pipe, key=lambda r: r["hidden_fraction"] or 0)
        res["pipeline_best"] = {k: top[k] for k in ("layer_groups", "compute_tokens",
                                                   "hidden_fraction", "ttft_serial_s",
                                                   "ttft_pipelined_s")}
    if not res["all_bytes_equal"]:
        res["status"] = report["status"] = "failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    ap.add_argument("--blocks", type=int, default=DEFAULTS["blocks"])
    ap.add_argument("--stored-gib", type=float, default=DEFAULTS["stored_gib"])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--staging-mib", type=float, nargs="+", default=DEFAULTS["staging_mib"],
                    help="staging buffer sizes to run (MiB each)")
    ap.add_argument("--chunk-tokens", type=int, nargs="*", default=DEFAULTS["chunk_tokens"],
                    help="chunk sizes of the throughput part (none: skip it)")
    ap.add_argument("--layer-groups", type=int, nargs="+", default=DEFAULTS["layer_groups"],
                    help="objects per chunk along the layers (throughput part)")
    ap.add_argument("--pipeline-groups", type=int, nargs="*",
                    default=DEFAULTS["pipeline_groups"],
                    help="layer groups of the pipelining part (none: skip it)")
    ap.add_argument("--pipeline-layouts", nargs="+", default=DEFAULTS["pipeline_layouts"],
                    choices=("short-first", "even"),
                    help="layer groups of the pipelining part: the product's (a short "
                         "first group) and/or equal groups, for comparison")
    ap.add_argument("--pipeline-locate", nargs="+", default=DEFAULTS["pipeline_locate"],
                    choices=("split", "one"),
                    help="how a pipelined read locates its keys: part 0's first and the "
                         "rest's while it moves (split), or one RPC (one)")
    ap.add_argument("--pipeline-words", type=int, nargs="+", default=DEFAULTS["pipeline_words"],
                    choices=(16, 8, 1),
                    help="widest word (bytes) gathers and scatters copy rows in: the "
                         "product's (16) and/or narrower ones, for comparison")
    ap.add_argument("--pipeline-handoff", nargs="+", default=DEFAULTS["pipeline_handoff"],
                    choices=("scatter", "fixed"),
                    help="after the first group arrived, the fetch thread waits for its "
                         "scatter (scatter) or pauses a fixed 0.2 ms (fixed), for comparison")
    ap.add_argument("--pipeline-first-copy", nargs="+",
                    default=DEFAULTS["pipeline_first_copy"], choices=("ahead", "late"),
                    help="the first group's copy made before its data arrives (ahead) or "
                         "when it arrived (late), for comparison")
    ap.add_argument("--pipeline-lookup", nargs="+", default=DEFAULTS["pipeline_lookup"],
                    choices=("scheduler", "none"),
                    help="each pipelined load made by the scheduler-side connector's lookup "
                         "right before the step (scheduler: the worker reads the first group "
                         "from its answers) or by hand (none: the worker locates it), for "
                         "comparison")
    ap.add_argument("--wait-at", default=DEFAULTS["wait_at"], choices=("attention", "layer"),
                    help="where a layer waits for its KV: in its attention op, after the "
                         "QKV projection (attention: as vLLM's attention op calls "
                         "wait_for_layer_load), or before any of its work (layer)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the garbage collector's heap unfrozen (vLLM's engine core "
                         "freezes it after start-up: gen-2 collections then skip it)")
    ap.add_argument("--idle-ms", type=float, default=DEFAULTS["idle_ms"],
                    help="pipelining part: the GPU idles this long before every run, so "
                         "that every mode starts at the same clocks")
    ap.add_argument("--hit-tokens", type=int, default=DEFAULTS["hit_tokens"])
    ap.add_argument("--compute-tokens", type=int, nargs="+", default=DEFAULTS["compute_tokens"])
    ap.add_argument("--repeat", type=int, default=DEFAULTS["repeat"])
    a = ap.parse_args()
    report: dict[str, Any] = {}
    over: dict[str, Any] = dict(
        layers=a.layers, blocks=a.blocks, stored_gib=a.stored_gib, device=a.device,
        staging_mib=a.staging_mib, repeat=a.repeat, chunk_tokens=tuple(a.chunk_tokens),
        layer_groups=tuple(a.layer_groups), pipeline_groups=tuple(a.pipeline_groups),
        hit_tokens=a.hit_tokens, compute_tokens=tuple(a.compute_tokens),
        pipeline_layouts=tuple(a.pipeline_layouts), pipeline_locate=tuple(a.pipeline_locate),
        pipeline_words=tuple(a.pipeline_words), pipeline_handoff=tuple(a.pipeline_handoff),
        pipeline_first_copy=tuple(a.pipeline_first_copy),
        pipeline_lookup=tuple(a.pipeline_lookup), idle_ms=a.idle_ms, wait_at=a.wait_at,
        gc_freeze=not a.no_gc_freeze)
    if a.device == "cpu":  # a dry run: small model, small sizes
        over.update(hidden=256, mlp=512, q_heads=8, layers=8, blocks=512, stored_gib=0.03,
                    hit_tokens=1024, chunk_tokens=(256,), compute_tokens=(256,),
                    pipeline_groups=(4,), layer_groups=(1, 4), repeat=1)
    run(report, **over)
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""``kvpool demo``: a small pool on loopback running a KV-cache-like workload.

Starts a master and two node daemons (subprocesses, temp dirs), then acts as a
pure client the way an inference engine would: each request is a prompt of
1..``max_chunks`` chunks whose keys chain over the prefix (``hash(prev_key +
chunk)``); with probability ``hit_rate`` a request continues an earlier prompt,
so the engine finds its longest stored prefix (batch exists), reads it back
(batch get_into, verified) and stores only the new chunks. Values are 1-16 MiB
(KV blocks of one chunk); a fraction of prompts is stored with 2 replicas. The
pool is smaller than what is written, so the master evicts as it goes.

At the end it prints a summary table, kills one daemon (SIGKILL), waits until
the master drops it, and shows that every 2-replica key that was present is
still readable, and shuts everything down.
"""

from __future__ import annotations

import hashlib
import logging
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from kvpool.cluster.demo_config import DemoConfig
from kvpool.core.config import format_size
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import StatsReply
from kvpool.store.client import Client
from kvpool.store.config import ClientConfig, ReplicateConfig
from kvpool.store.errors import StoreError

__all__ = ["DemoConfig", "run_demo"]

log = logging.getLogger(__name__)


@dataclass
class _Stats:
    lat: dict[str, list[float]] = field(default_factory=lambda: {"put": [], "get": []})
    nbytes: dict[str, int] = field(default_factory=lambda: {"put": 0, "get": 0})
    busy: dict[str, float] = field(default_factory=lambda: {"put": 0.0, "get": 0.0})
    chunks_wanted: int = 0  # chunks of continued prompts that were stored before
    chunks_hit: int = 0
    put_failed: dict[str, int] = field(default_factory=dict)
    verified: int = 0
    corrupt: int = 0


def _chain(prev: str, salt: int) -> str:
    return hashlib.sha256(f"{prev}|{salt}".encode()).hexdigest()[:32]


class _Progress:
    def __init__(self, total: int, out: TextIO, enabled: bool) -> None:
        self.total, self.out, self.enabled = total, out, enabled
        self.t0 = time.monotonic()

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / max(1, self.total))
        rate = done / max(1e-9, time.monotonic() - self.t0)
        self.out.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                       f"requests  {rate:5.1f} req/s {note:<24}")
        self.out.flush()

    def close(self) -> None:
        if self.enabled:
            self.out.write("\n")
            self.out.flush()


def _pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p)) if xs else float("nan")


def _value_view(pool: np.ndarray, key: str, size: int) -> np.ndarray:
    """Deterministic content for ``key``: a slice of a random pool at a key-derived offset."""
    off = int(key[:8], 16) % (len(pool) - size + 1)
    return pool[off:off + size]


def run_demo(cfg: DemoConfig, out: TextIO = sys.stdout) -> int:
    """Run the demo; return 0 when every check passed."""
    from kvpool.cluster.local import LocalCluster

    for name in ("kvpool.transfer", "kvpool.store.client"):  # keep the demo's output readable
        logging.getLogger(name).setLevel(logging.WARNING)
    rng = random.Random(cfg.seed)
    tmp = tempfile.mkdtemp(prefix="kvpool-demo-")
    pool = np.random.default_rng(cfg.seed).integers(
        0, 255, size=cfg.max_value * 2, dtype=np.uint8)
    print(f"kvpool demo: master + 2 node daemons x {format_size(cfg.memory)} on loopback "
          f"(work dir {tmp})", file=out)
    cluster = LocalCluster(nodes=2, memory=cfg.memory, work_dir=tmp,
                           client_ttl_s=cfg.client_ttl_s, lease_ttl_ms=2000)
    client: Client | None = None
    try:
        t_start = time.monotonic()
        cluster.start()
        print(f"  cluster up in {time.monotonic() - t_start:.1f}s: master {cluster.address}, "
              f"segments {cluster.segment_ids}", file=out)
        client = Client(ClientConfig(master_address=cluster.address, memory_size=0,
                                     checksum="crc32"))
        client.setup()
        st = _Stats()
        prompts: list[list[tuple[str, int, bool]]] = []  # chunk chains: (key, size, replicated)
        buf = np.empty(cfg.max_value, dtype=np.uint8)
        # A shared system prompt: its chunks are hot for every engine, so they are
        # stored with 2 replicas and hard-pinned (never evicted).
        system: list[tuple[str, int, bool]] = []
        prev = f"system-{cfg.seed}"
        pin = ReplicateConfig(replica_num=2, with_hard_pin=True)
        for _ in range(cfg.system_chunks):
            key = _chain(prev, 0)
            size = cfg.min_value
            client.put_from(key, _value_view(pool, key, size), pin)
            system.append((key, size, True))
            prev = key
        if system:
            prompts.append(system)
        progress = _Progress(cfg.requests, sys.stderr,
                             sys.stderr.isatty() if cfg.progress is None else cfg.progress)
        t_run = time.monotonic()
        for n in range(cfg.requests):
            chain: list[tuple[str, int, bool]] = []
            if prompts and rng.random() < cfg.hit_rate:
                chain = list(rng.choice(prompts))
                keys = [k for k, _, _ in chain]
                st.chunks_wanted += len(keys)
                present = client.batch_exists(keys)
                hit = 0
                while hit < len(present) and present[hit]:
                    hit += 1
                for key, size, _ in chain[:hit]:  # read back the stored prefix
                    t = time.perf_counter()
                    try:
                        got = client.get_into(key, buf)
                    except StoreError as exc:
                        log.debug("get %s: %s", key, exc)
                        break
                    dt = time.perf_counter() - t
                    st.lat["get"].append(dt)
                    st.busy["get"] += dt
                    st.nbytes["get"] += got
                    st.chunks_hit += 1
                    if np.array_equal(buf[:got], _value_view(pool, key, size)):
                        st.verified += 1
                    else:
                        st.corrupt += 1
                chain = chain[:hit]
            replicated = rng.random() < cfg.replicated_fraction
            rc = ReplicateConfig(replica_num=2 if replicated else 1)
            prev = chain[-1][0] if chain else f"demo-{cfg.seed}-{n}"
            for _ in range(rng.randint(1, cfg.max_chunks)):
                key = _chain(prev, rng.randrange(1 << 30))
                size = rng.randint(cfg.min_value, cfg.max_value)
                t = time.perf_counter()
                try:
                    client.put_from(key, _value_view(pool, key, size), rc)
                except StoreError as exc:
                    name = ErrorCode(exc.code).name
                    st.put_failed[name] = st.put_failed.get(name, 0) + 1
                    break
                dt = time.perf_counter() - t
                st.lat["put"].append(dt)
                st.busy["put"] += dt
                st.nbytes["put"] += size
                chain.append((key, size, replicated))
                prev = key
            if chain:
                prompts.append(chain)
            progress.update(n + 1)
        progress.close()
        wall = time.monotonic() - t_run
        stats = client.stats()
        _summary(out, cfg, st, stats, wall)
        ok = st.corrupt == 0
        ok &= _kill_and_check(out, client, cluster.daemons[1], prompts, pool, cfg)
        print(f"  done in {time.monotonic() - t_start:.1f}s: {'OK' if ok else 'FAILED'}", file=out)
        return 0 if ok else 1
    finally:
        if client is not None:
            client.close()
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _summary(out: TextIO, cfg: DemoConfig, st: _Stats, stats: StatsReply, wall: float) -> None:
    rows = [("op", "count", "bytes", "GB/s", "p50 ms", "p90 ms", "p99 ms")]
    for op in ("put", "get"):
        lat = st.lat[op]
        gbps = st.nbytes[op] / st.busy[op] / 1e9 if st.busy[op] else 0.0
        rows.append((op, str(len(lat)), format_size(st.nbytes[op]), f"{gbps:.2f}",
                     f"{_pct(lat, 50) * 1e3:.2f}", f"{_pct(lat, 90) * 1e3:.2f}",
                     f"{_pct(lat, 99) * 1e3:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("", file=out)
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)), file=out)
    hit = st.chunks_hit / st.chunks_wanted if st.chunks_wanted else 0.0
    print("", file=out)
    print(f"  requests {cfg.requests} in {wall:.1f}s; prefix hit rate {100 * hit:.1f}% "
          f"({st.chunks_hit}/{st.chunks_wanted} chunks of continued prompts); "
          f"reads verified {st.verified}, corrupt {st.corrupt}", file=out)
    print(f"  pool: {stats.objects} objects, "
          f"{format_size(stats.bytes_used)} / "
          f"{format_size(stats.bytes_capacity)} used; evictions {stats.evictions}; "
          f"failed puts {st.put_failed or 0}", file=out)


def _kill_and_check(out: TextIO, client: Client, victim: Any,
                    prompts: list[list[tuple[str, int, bool]]], pool: np.ndarray,
                    cfg: DemoConfig) -> bool:
    replicated = {k: s for chain in prompts for k, s, r in chain if r}
    keys = list(replicated)
    present = []
    for k, e in zip(keys, client.batch_exists(keys), strict=True):
        # keys the master could place on both segments (it gives fewer when one is full)
        if e and len(client.replica_segments(k)) >= 2:
            present.append(k)
    victim_segments = set(victim.segment_ids)
    print(f"\n  killing node daemon {victim.segment_ids} (SIGKILL) with {len(present)} "
          f"2-replica keys in the pool ...", file=out)
    victim.kill()
    # its guard process sees it die, frees its shared memory and unmounts it
    deadline = time.monotonic() + cfg.client_ttl_s * 3 + 5
    while time.monotonic() < deadline:
        segs = {s.descriptor.segment_id for s in client.list_segments()}
        if not victim_segments & segs:
            break
        time.sleep(0.2)
    else:
        print("  the killed daemon's segment was not unmounted in time", file=out)
        return False
    readable = 0
    buf = np.empty(cfg.max_value, dtype=np.uint8)
    for k in present:
        try:
            n = client.get_into(k, buf)
        except StoreError as exc:
            log.info("replicated key %s lost: %s", k, exc)
            continue
        if np.array_equal(buf[:n], _value_view(pool, k, replicated[k])):
            readable += 1
    print(f"  its guard unmounted it; 2-replica keys still readable and intact: "
          f"{readable}/{len(present)}", file=out)
    return readable == len(present)

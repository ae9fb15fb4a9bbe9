#!/usr/bin/env python
"""Benchmark the master's limits (issue 28): restore speed, many clients, a long journal.

Modes (each writes JSON with ``--json``; numbers on stderr as it goes):

``restore``: restart time of a data dir of ``--objects`` objects (40-char
keys, one replica each, 4 segments). Two data dirs are built in-process
through the real Directory + Durability (put batches, group commits): one
whose objects are all in a snapshot (the state after a periodic snapshot)
and one whose objects are all in the journal (a crash before the first
snapshot). Each is then restored ``--repeat`` times in a fresh process
(``Durability.restore``: the one load path a master runs at start), which
reports objects/s and RSS per object. ``--base DIR``: also restore with the
tree in DIR (e.g. ``git worktree add /tmp/lim-base <commit>``), interleaved
run by run with this tree, and report this tree's speed over the base's
(the VM's speed drifts; a ratio of interleaved runs does not).

Usage:
  scripts/bench_limits.py restore --objects 1000000 [--base /tmp/lim-base] --json OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["main"]

log = logging.getLogger("bench_limits")

_KEYS_PER_BATCH = 4096


def key(prefix: str, i: int) -> str:
    return f"{prefix}-{i:012d}-{(i * 2654435761) & 0xFFFFFFFF:08x}-kvpool-b"[:40]


# ---------------------------------------------------------------- restore
def build_data_dir(path: str, objects: int, snapshot: bool) -> dict[str, Any]:
    """A data dir of ``objects`` objects made by the real write path; with
    ``snapshot`` they end up in a snapshot (journal after it: empty)."""
    from kvpool.core.protocol import SegmentDescriptor, SegmentKind
    from kvpool.master.config import FsyncPolicy, MasterConfig
    from kvpool.master.directory import Directory
    from kvpool.master.durability import Durability

    cfg = MasterConfig(data_dir=path, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    for i in range(4):
        d.mount("bench", SegmentDescriptor(f"bench-seg-{i}", "bench", "host-bench",
                                           SegmentKind.MEMORY, 64 << 40, f"kvpool-bench-seg-{i}"))
    dur.commit(d.records)
    t0 = time.perf_counter()
    for base in range(0, objects, _KEYS_PER_BATCH):
        keys = [key("obj", i) for i in range(base, min(objects, base + _KEYS_PER_BATCH))]
        codes = [0] * len(keys)
        d.writes.put_start_many("bench", keys, [4096] * len(keys), codes, [None] * len(keys))
        if any(codes):
            raise SystemExit(f"fill failed: {codes[:4]}")
        d.writes.commit_many("bench", keys)
        dur.commit(d.records)
    fill_s = time.perf_counter() - t0
    if snapshot:
        dur.request_snapshot()
        while True:
            dur.tick(d, time.monotonic())
            if dur.stats.snapshots:
                break
    assert dur.journal is not None
    dur.close([])
    sizes = {name: os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)}
    return {"objects": len(d.objects), "fill_s": round(fill_s, 2), "files": sizes}


def restore_once() -> dict[str, Any]:
    """(In a fresh process) restore the data dir in argv[2]; print the numbers as JSON."""
    from kvpool.master.config import FsyncPolicy, MasterConfig
    from kvpool.master.directory import Directory
    from kvpool.master.durability import Durability

    path = sys.argv[2]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(f"/proc/{os.getpid()}/statm") as f:
        cur0 = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    cfg = MasterConfig(data_dir=path, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0)
    dur = Durability(cfg)
    t0 = time.perf_counter()
    c0 = time.process_time()
    # as MasterServer does around its restore: no cyclic GC passes over the new objects
    gc.disable()
    d = dur.restore(lambda: Directory(cfg))
    gc.enable()
    gc.freeze()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    with open(f"/proc/{os.getpid()}/statm") as f:
        cur1 = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    n = len(d.objects)
    out = {"objects": n, "restore_s": round(wall, 3), "restore_cpu_s": round(cpu, 3),
           "objects_per_s": round(n / wall), "rss_bytes_per_object": round((cur1 - cur0) / n, 1),
           "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "rss0_kb": rss0}
    # the newest journal the restore opened is empty: drop it, the next run opens its own
    assert dur.journal is not None
    seq = dur.journal.seq
    dur.close([])
    os.unlink(os.path.join(path, f"journal-{seq:012d}.log"))
    print(json.dumps(out))
    return out


def _tree_env(tree: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if tree:  # the base tree as the package kvpool
        pkg = tempfile.mkdtemp(prefix="kvpool-base-pkg-")
        os.symlink(os.path.abspath(tree), os.path.join(pkg, "kvpool"))
        env["PYTHONPATH"] = pkg
    return env


def in_tree(tree: str | None, *args: str) -> dict[str, Any]:
    """Run this script's ``args`` in a fresh process with ``tree`` as the
    package (None: this tree); its last stdout line (JSON)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                         env=_tree_env(tree), check=True, capture_output=True, text=True,
                         timeout=1800)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def restore_mode(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"objects": args.objects, "cpus": os.cpu_count(),
                               "base": args.base, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-restore-") as tmp:
        for case in args.cases.split(","):
            trees = {"base": args.base, "new": None} if args.base else {"new": None}
            built = {}
            for which, tree in trees.items():  # each tree writes its own format
                path = os.path.join(tmp, f"{case}-{which}")
                built[which] = in_tree(tree, "_build", path, str(args.objects), case)
                print(f"{case} {which}: built {built[which]}", file=sys.stderr, flush=True)
            runs: dict[str, list[dict[str, Any]]] = {"new": [], "base": []}
            for _ in range(args.repeat):
                for which, tree in trees.items():
                    r = in_tree(tree, "_restore_once", os.path.join(tmp, f"{case}-{which}"))
                    runs[which].append(r)
                    print(f"{case} {which}: {r['objects']:,} objects in {r['restore_s']} s "
                          f"({r['objects_per_s']:,}/s), {r['rss_bytes_per_object']} B/object",
                          file=sys.stderr, flush=True)
            case_out: dict[str, Any] = {"data_dir": built, "runs": runs}
            for which, rs in runs.items():
                if rs:
                    case_out[f"{which}_objects_per_s_median"] = round(
                        statistics.median(r["objects_per_s"] for r in rs))
            if args.base:
                ratios = [n["objects_per_s"] / b["objects_per_s"]
                          for n, b in zip(runs["new"], runs["base"], strict=True)]
                case_out["speedup_per_run"] = [round(x, 2) for x in ratios]
                case_out["speedup_median"] = round(statistics.median(ratios), 2)
            results["cases"][case] = case_out
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_restore_once":
        restore_once()
        return 0
    if argv and argv[0] == "_build":
        print(json.dumps(build_data_dir(argv[1], int(argv[2]), argv[3] == "snapshot")))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    rp = sub.add_parser("restore", help="restart time of a data dir")
    rp.add_argument("--objects", type=int, default=1_000_000)
    rp.add_argument("--repeat", type=int, default=3)
    rp.add_argument("--cases", default="snapshot,journal",
                    help="snapshot: objects in a snapshot; journal: in the journal only")
    rp.add_argument("--base", help="also restore with this tree (interleaved) and compare")
    rp.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = restore_mode(args)
    out = json.dumps(results, indent=2)
    print(out)
    if args.json:
        with open(args.json, "w") as f:
            f.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

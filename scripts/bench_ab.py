"""Interleaved A/B runs of the benchmarks: a base tree against the working tree.

The machines these benchmarks run on change speed by up to 2x within minutes
(docs/BENCHMARKS.md, "The machine's speed"), so two trees compare only
when their runs interleave: base, head, base, head, ... for N rounds, each
benchmark in turn. Each tree runs its *own* scripts against its *own* kvpool,
under this interpreter and its installed dependencies: a link tree
``<work>/<side>-py/kvpool/<layer> -> <tree>/<folder>``, built from the tree's
``pyproject.toml`` package-dir mapping, goes first on PYTHONPATH (inherited by
every process a benchmark starts), where it wins over an installed or
editable kvpool. So the base needs no venv and no install: this runs offline
on any machine where the head's dependencies are importable.

The base tree is ``git archive`` of the base commit (default: the merge-base
of HEAD with ``main``) unpacked under the work directory, or ``--base-dir``.
Every benchmark is called with ``--json FILE`` (or ``{json}`` in its arguments
is replaced); ``bench_master.py --quick``, which prints its phases instead,
is read from stdout. The table gives, per record (transport / op / size /
batch) and metric, the median of each side, head / base, and a verdict
against the band: higher is better for rates (``gbps``, ``ops_per_s``, ...),
lower for latencies, CPU per key and sizes. Limits and machine yardsticks
(memcpy, sockets, iperf3, disk, Mooncake, ``python_loop``) are shown but not
judged: they say whether the machine moved between the sides.

Usage:
  python scripts/bench_ab.py                       # the default list, 3 rounds
  python scripts/bench_ab.py --rounds 1 --bench "bench_master.py --quick --seconds 1" \\
      --bench "bench_store.py --sizes 4096 --transports shm --max-iters 200" --json ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_host import python_loop_us  # scripts/ is sys.path[0] when run as a script

__all__ = [
    "DEFAULT_BENCHES",
    "HIGHER_BETTER",
    "LOWER_BETTER",
    "Bench",
    "Row",
    "Run",
    "format_table",
    "link_tree",
    "main",
    "records_of",
    "summarize",
    "verdict",
]

HEAD_DIR = Path(__file__).resolve().parent.parent

DEFAULT_BENCHES = (
    "bench_store.py --sizes 4096,16777216 --transports shm,tcp",
    "bench_master.py --quick",
    "bench_tier.py --batches 8 --rounds 1 --no-buffered",
)

HIGHER_BETTER = frozenset({
    "gbps", "ops_per_s", "key_ops_per_s", "master_cpu_key_ops_per_s", "x_limit",
    "fill_objects_per_s",
})
LOWER_BETTER = frozenset({
    "p50_us", "p99_us", "rpc_p50_us", "client_cpu_us_per_key", "master_cpu_us_per_key",
    "holder_cpu_us_per_key", "first_put_ms", "first_get_ms", "retrans",
    "rss_bytes_per_object", "start_pause_ms", "start_pause_cpu_ms", "max_step_ms",
    "max_step_cpu_ms", "ping_max_ms_during", "cpu_us_per_call", "opcodes_per_call",
    "py_calls_per_call",
})
# Fields that measure the machine, not the code under test.
MACHINE_METRICS = frozenset({"host_steal_pct", "python_loop_us"})
# Records of these transports are limits or yardsticks measured in the same run.
YARDSTICKS = frozenset({
    "host", "memcpy", "memcpy_shm", "socket", "iperf3", "links", "disk", "store-disk",
    "mooncake", "ab",
})
LARGE = 1 << 20  # from this size on, a record's rate is read in GB/s


@dataclasses.dataclass(frozen=True)
class Bench:
    """One benchmark command: a script under the tree's scripts/ and its arguments."""

    script: str
    args: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> Bench:
        """``"bench_store.py --sizes 4096"`` (``scripts/`` may be given or left out)."""
        words = shlex.split(spec)
        if not words:
            raise ValueError("empty benchmark command")
        return cls(words[0].removeprefix("scripts/"), tuple(words[1:]))

    @property
    def label(self) -> str:
        return " ".join([self.script, *self.args])

    def argv(self, python: str, tree: Path, json_path: Path) -> list[str]:
        """The command line in ``tree``: ``{json}`` replaced, else ``--json PATH`` added."""
        args = [a.replace("{json}", str(json_path)) for a in self.args]
        if not any("{json}" in a for a in self.args):
            args += ["--json", str(json_path)]
        return [python, str(tree / "scripts" / self.script), *args]


@dataclasses.dataclass
class Run:
    """One benchmark run of one side: its exit status and normalized records."""

    bench: str
    side: str
    round: int
    rc: int
    seconds: float
    python_loop_us: float
    records: list[dict[str, Any]]
    log: str = ""


@dataclasses.dataclass
class Row:
    """One line of the table: a record's metric on both sides."""

    bench: str
    record: str
    metric: str
    kind: str  # "code" (judged), "limit" or "machine" (shown only)
    base: list[float]
    head: list[float]

    @property
    def base_median(self) -> float | None:
        return statistics.median(self.base) if self.base else None

    @property
    def head_median(self) -> float | None:
        return statistics.median(self.head) if self.head else None

    @property
    def ratio(self) -> float | None:
        b, h = self.base_median, self.head_median
        if b is None or h is None or b == 0:
            return None
        return h / b

    @property
    def overlap(self) -> bool | None:
        """Whether the two sides' ranges overlap (a verdict that may be the
        machine's, not the code's); None with fewer than two runs a side."""
        if len(self.base) < 2 or len(self.head) < 2:
            return None
        return max(self.base) >= min(self.head) and max(self.head) >= min(self.base)

    def verdict(self, band: float) -> str:
        if self.kind != "code":
            return f"({self.kind})"
        return verdict(self.metric, self.base_median, self.head_median, band)

    def as_dict(self, band: float) -> dict[str, Any]:
        return {"bench": self.bench, "record": self.record, "metric": self.metric,
                "kind": self.kind, "base": self.base, "head": self.head,
                "base_median": self.base_median, "head_median": self.head_median,
                "ratio": None if self.ratio is None else round(self.ratio, 4),
                "verdict": self.verdict(band), "ranges_overlap": self.overlap}


def verdict(metric: str, base: float | None, head: float | None, band: float) -> str:
    """``within`` when head is within ``band`` (a fraction) of base, else ``better``
    or ``WORSE`` by the metric's direction; ``missing`` when a side has no value,
    ``?`` for a metric of unknown direction."""
    if base is None or head is None:
        return "missing"
    if base == 0:
        return "within" if head == 0 else "?"
    ratio = head / base
    if 1 - band <= ratio <= 1 + band:
        return "within"
    if metric in HIGHER_BETTER:
        return "better" if ratio > 1 else "WORSE"
    if metric in LOWER_BETTER:
        return "better" if ratio < 1 else "WORSE"
    return "?"


def records_of(doc: Any) -> list[dict[str, Any]]:
    """The records of one benchmark's JSON, in one shape: ``{transport, op, size,
    batch, <metrics>}``. bench_store/bench_tier/bench_transfer write such a list;
    bench_master's phases (its ``ops``, or ``--quick``'s printed list) become
    transport ``master``, its memory and snapshot results ops ``rss`` and
    ``snapshot``, its ``python_loop_us_start`` a ``host`` record."""
    if isinstance(doc, list):
        if doc and all(isinstance(r, dict) and "transport" in r for r in doc):
            return [dict(r) for r in doc]
        if all(isinstance(r, dict) and "key_ops_per_s" in r for r in doc):
            return [_master_phase(p) for p in doc]
        return []
    if not isinstance(doc, dict):
        return []
    out = [_master_phase(p) for p in doc.get("ops", []) if isinstance(p, dict)]
    mem = doc.get("memory")
    if isinstance(mem, dict):
        out.append({"transport": "master", "op": "rss", "size": mem.get("objects", 0),
                    "batch": 0, "rss_bytes_per_object": mem.get("rss_bytes_per_object")})
    snap = doc.get("snapshot")
    if isinstance(snap, dict):
        out.append({"transport": "master", "op": "snapshot", "size": 0, "batch": 0,
                    **{k: snap[k] for k in ("start_pause_ms", "start_pause_cpu_ms",
                                            "max_step_ms", "max_step_cpu_ms",
                                            "ping_max_ms_during") if k in snap}})
    if isinstance(doc.get("python_loop_us_start"), int | float):
        out.append({"transport": "host", "op": "python_loop", "size": 0, "batch": 1,
                    "p50_us": doc["python_loop_us_start"]})
    return out


def _master_phase(p: Mapping[str, Any]) -> dict[str, Any]:
    return {"transport": "master", "op": p.get("op"), "size": 0, "batch": p.get("batch"),
            **{k: p[k] for k in ("key_ops_per_s", "master_cpu_key_ops_per_s", "rpc_p50_us")
               if k in p}}


def _size(n: Any) -> str:
    if not isinstance(n, int) or n <= 0:
        return str(n)
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def record_keys(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """A name per record, ``transport op size xbatch (when)`` (batch 1 and size 0
    left out); a name that repeats within
    one run (e.g. the 1- and 2-connection socket limits) gets ``#2``, ``#3``."""
    seen: dict[str, int] = {}
    out = []
    for r in records:
        words = [str(r.get("transport")), str(r.get("op"))]
        if r.get("size"):
            words.append(_size(r.get("size")))
        if r.get("batch") not in (None, 0, 1) or r.get("transport") == "master":
            words.append(f"x{r.get('batch')}")
        if r.get("when"):
            words.append(f"({r['when']})")
        key = " ".join(words)
        seen[key] = seen.get(key, 0) + 1
        out.append(key if seen[key] == 1 else f"{key} #{seen[key]}")
    return out


def metrics_of(record: Mapping[str, Any], which: str | Sequence[str]) -> list[str]:
    """The metrics of a record to compare: ``auto`` = its rate (GB/s from 1 MiB on,
    else ops/s; a master phase: key-ops per master CPU-s) and p50; ``all`` = every
    numeric field of known direction; else the named ones present."""
    numeric = [k for k, v in record.items()
               if isinstance(v, int | float) and not isinstance(v, bool)
               and k not in ("size", "batch", "bytes")]
    if which == "all":
        return [k for k in numeric if k in HIGHER_BETTER | LOWER_BETTER | MACHINE_METRICS]
    if which != "auto":
        return [k for k in which if k in numeric]
    if record.get("transport") == "host":
        wanted = ["p50_us"]
    elif record.get("transport") == "master":
        wanted = ["master_cpu_key_ops_per_s", "rpc_p50_us", "rss_bytes_per_object",
                  "start_pause_ms", "max_step_ms"]
    elif "cpu_us_per_call" in record:  # bench_client_cpu: CPU and bytecodes
        wanted = ["cpu_us_per_call", "opcodes_per_call"]
    else:
        size = record.get("size")
        rate = "gbps" if isinstance(size, int) and size >= LARGE else "ops_per_s"
        wanted = [rate, "p50_us", "x_limit"]  # x_limit: against the limit of the same run
    if wanted[0] == "ops_per_s" and not record.get("ops_per_s"):
        wanted[0] = "gbps"  # a limit that reports GB/s only (iperf3)
    return [k for k in wanted if k in numeric and record[k]]  # 0: not measured


def summarize(runs: Sequence[Run], metrics: str | Sequence[str] = "auto") -> list[Row]:
    """Rows of every (benchmark, record, metric) seen, in first-seen order, with
    each side's values over the rounds; plus a ``python_loop`` row per benchmark
    from the yardstick taken right before each run."""
    rows: dict[tuple[str, str, str], Row] = {}
    for run in runs:
        if run.rc != 0:
            continue
        for key, rec in zip(record_keys(run.records), run.records, strict=True):
            yardstick = rec.get("transport") in YARDSTICKS
            for m in metrics_of(rec, metrics):
                kind = ("machine" if m in MACHINE_METRICS or rec.get("transport") == "host"
                        else "limit" if yardstick else "code")
                row = rows.setdefault((run.bench, key, m), Row(run.bench, key, m, kind, [], []))
                (row.base if run.side == "base" else row.head).append(float(rec[m]))
        if run.python_loop_us > 0:
            row = rows.setdefault((run.bench, "ab python_loop (before the run)", "p50_us"),
                                  Row(run.bench, "ab python_loop (before the run)", "p50_us",
                                      "machine", [], []))
            (row.base if run.side == "base" else row.head).append(run.python_loop_us)
    return list(rows.values())


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(v))))
    return f"{v:,.{min(digits, 4)}f}"


def format_table(rows: Sequence[Row], band: float) -> str:
    """Markdown: per benchmark a heading and a table of record, metric, base median
    [min-max], head median [min-max], head / base, verdict and whether the two
    ranges overlap; the judged rows first, then the limits and the machine
    yardsticks."""
    order = {"code": 0, "limit": 1, "machine": 2}
    out: list[str] = []

    def side(vals: list[float]) -> str:
        if not vals:
            return "-"
        med = _fmt(statistics.median(vals))
        return med if len(vals) == 1 else f"{med} [{_fmt(min(vals))}-{_fmt(max(vals))}]"

    for bench in dict.fromkeys(r.bench for r in rows):
        out += [f"### {bench}", "",
                "| record | metric | base median [range] | head median [range] | head/base "
                "| verdict | ranges overlap |", "|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r.bench == bench), key=lambda r: order[r.kind]):
            ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
            overlap = {None: "-", True: "yes", False: "no"}[r.overlap]
            out.append(f"| {r.record} | {r.metric} | {side(r.base)} | {side(r.head)} | "
                       f"{ratio} | {r.verdict(band)} | {overlap} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# --- trees -----------------------------------------------------------------------------

def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def _head_commit(tree: Path) -> str:
    """The tree's HEAD commit, "" where it is no git checkout (a copied tree)."""
    try:
        return _git(tree, "rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return ""


def base_commit(head_dir: Path, ref: str | None) -> tuple[str, str]:
    """(what to call it, commit): ``ref``, or the merge-base of HEAD with main."""
    if ref:
        return ref, _git(head_dir, "rev-parse", "--verify", f"{ref}^{{commit}}")
    return "merge-base(HEAD, main)", _git(head_dir, "merge-base", "HEAD", "main")


def export_tree(repo: Path, commit: str, dest: Path) -> Path:
    """Unpack ``commit``'s files into ``dest`` (``git archive | tar -x``: no
    worktree entry is left behind in the repository)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "archive", "--format=tar", commit], cwd=repo,
                               stdout=subprocess.PIPE)
    try:
        subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    finally:
        assert archive.stdout is not None
        archive.stdout.close()
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {commit} failed")
    return dest


def link_tree(tree: Path, dest: Path) -> Path:
    """A directory to put first on PYTHONPATH so that ``import kvpool.<layer>``
    loads ``tree``'s folders: ``dest/kvpool/<layer>`` links to each folder of
    the tree's pyproject package-dir mapping (``kvpool`` stays a namespace
    package). A tree with a plain ``kvpool/`` package is its own entry."""
    pyproject = tree / "pyproject.toml"
    mapping: dict[str, str] = {}
    if pyproject.exists():
        with open(pyproject, "rb") as f:
            setuptools = tomllib.load(f).get("tool", {}).get("setuptools", {})
        mapping = dict(setuptools.get("package-dir", {}))
    layers = {k.split(".", 1)[1]: v for k, v in mapping.items()
              if k.startswith("kvpool.") and k.count(".") == 1}
    if not layers:
        if (tree / "kvpool").is_dir():
            return tree
        raise RuntimeError(f"{tree}: no kvpool package-dir mapping in pyproject.toml")
    pkg = dest / "kvpool"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    for layer, folder in layers.items():
        (pkg / layer).symlink_to((tree / folder).resolve(), target_is_directory=True)
    return dest


def _load_output(json_path: Path, stdout: str) -> Any:
    """The run's JSON file, else the JSON it printed (bench_master.py --quick)."""
    if json_path.exists() and json_path.stat().st_size:
        with open(json_path) as f:
            return json.load(f)
    text = stdout.strip()
    for start in range(len(text)):
        if text[start] in "[{" and (start == 0 or text[start - 1] == "\n"):
            try:
                return json.loads(text[start:])
            except json.JSONDecodeError:
                continue
    return None


def run_bench(bench: Bench, side: str, rnd: int, tree: Path, pypath: Path, python: str,
              work: Path, timeout_s: float) -> Run:
    """Run one benchmark in ``tree`` with ``pypath`` first on PYTHONPATH."""
    slug = "".join(c if c.isalnum() else "_" for c in bench.label)[:60]
    out = work / "runs" / f"r{rnd}-{side}-{slug}"
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "out.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pypath), env.get("PYTHONPATH")) if p)
    loop = python_loop_us()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(bench.argv(python, tree, json_path), cwd=tree, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = 124, _text(exc.stdout), _text(exc.stderr) + "\n(timed out)"
    seconds = time.perf_counter() - t0
    (out / "stdout.txt").write_text(stdout)
    (out / "stderr.txt").write_text(stderr)
    records = records_of(_load_output(json_path, stdout)) if rc == 0 else []
    if rc == 0 and not records:
        rc, stderr = 65, stderr + "\n(no JSON records)"
    return Run(bench.label, side, rnd, rc, round(seconds, 1), loop, records,
               log=(stderr or stdout)[-2000:] if rc else "")


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None,
                    help="base git ref (default: the merge-base of HEAD with main)")
    ap.add_argument("--base-dir", type=Path, default=None,
                    help="use this tree as the base instead of unpacking --base")
    ap.add_argument("--head-dir", type=Path, default=HEAD_DIR,
                    help="the head tree (default: this checkout, uncommitted changes included)")
    ap.add_argument("--bench", action="append", default=[], metavar="CMD",
                    help="a benchmark: script under scripts/ and its arguments (repeatable; "
                    "default: " + "; ".join(DEFAULT_BENCHES) + ")")
    ap.add_argument("--rounds", type=int, default=3, help="base/head pairs per benchmark")
    ap.add_argument("--abba", action="store_true",
                    help="alternate which side goes first in each round (base-head, head-base)")
    ap.add_argument("--band", type=float, default=0.05,
                    help="a head/base ratio within 1 +- band is 'within'")
    ap.add_argument("--metrics", default="auto",
                    help="auto (rate + p50), all, or a comma-separated list of fields")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter for both sides (its packages are the deps)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--work", type=Path, default=None,
                    help="work directory (kept; default: a temp dir, removed at the end)")
    ap.add_argument("--json", type=Path, default=None, help="write every run and row here")
    ap.add_argument("--markdown", type=Path, default=None, help="write the table here too")
    args = ap.parse_args(argv)

    head_dir = args.head_dir.resolve()
    benches = [Bench.parse(s) for s in (args.bench or DEFAULT_BENCHES)]
    metrics: str | list[str] = (args.metrics if args.metrics in ("auto", "all")
                                else args.metrics.split(","))
    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="kvpool-ab-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.base_dir is not None:
            base_dir, base_name = args.base_dir.resolve(), str(args.base_dir)
            base_sha = _head_commit(base_dir)
        else:
            base_name, base_sha = base_commit(head_dir, args.base)
            base_dir = work / "base-tree"
            if not (base_dir / "pyproject.toml").exists():
                export_tree(head_dir, base_sha, base_dir)
        head_sha = _head_commit(head_dir)
        dirty = bool(head_sha and _git(head_dir, "status", "--porcelain", "--untracked-files=no"))
        trees = {"base": (base_dir, link_tree(base_dir, work / "base-py")),
                 "head": (head_dir, link_tree(head_dir, work / "head-py"))}
        print(f"base: {base_name} {base_sha[:12]} in {base_dir}", file=sys.stderr)
        print(f"head: {head_sha[:12]}{' + uncommitted changes' if dirty else ''} in {head_dir}",
              file=sys.stderr)
        if base_sha and base_sha == head_sha and not dirty:
            print("note: base and head are the same commit (an A/A run: the noise)",
                  file=sys.stderr)
        runs: list[Run] = []
        for rnd in range(1, args.rounds + 1):
            for bench in benches:
                order = ("head", "base") if args.abba and rnd % 2 == 0 else ("base", "head")
                for side in order:
                    tree, pypath = trees[side]
                    run = run_bench(bench, side, rnd, tree, pypath, args.python, work,
                                    args.timeout)
                    runs.append(run)
                    status = "ok" if run.rc == 0 else f"FAILED rc={run.rc}"
                    print(f"round {rnd}/{args.rounds} {side:4s} {bench.label}: {status}, "
                          f"{run.seconds} s, {len(run.records)} records, python_loop "
                          f"{run.python_loop_us} us", file=sys.stderr, flush=True)
                    if run.rc:
                        print(run.log, file=sys.stderr)
        rows = summarize(runs, metrics)
        table = format_table(rows, args.band)
        print(table)
        judged = [r for r in rows if r.kind == "code"]
        counts = {v: sum(r.verdict(args.band) == v for r in judged)
                  for v in ("within", "better", "WORSE", "missing", "?")}
        summary = (f"{len(judged)} judged rows, band +-{args.band:.0%}: "
                   + ", ".join(f"{n} {v}" for v, n in counts.items() if n))
        drift = [r for r in rows if r.record.startswith("ab python_loop")
                 and r.ratio is not None and abs(r.ratio - 1) > args.band]
        if drift:
            summary += ("; the machine's speed differed between the sides (python_loop "
                        + ", ".join(f"{_fmt(r.base_median)} vs {_fmt(r.head_median)} us"
                                    for r in drift) + "): more rounds, or --abba")
        print(summary)
        if args.markdown:
            args.markdown.write_text(table + "\n\n" + summary + "\n")
        if args.json:
            doc = {"base": {"ref": base_name, "commit": base_sha, "dir": str(base_dir)},
                   "head": {"commit": head_sha, "dirty": dirty, "dir": str(head_dir)},
                   "rounds": args.rounds, "band": args.band, "benches": [b.label for b in benches],
                   "python": args.python, "summary": summary,
                   "runs": [dataclasses.asdict(r) for r in runs],
                   "rows": [r.as_dict(args.band) for r in rows]}
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
        return 1 if any(r.rc for r in runs) else 0
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

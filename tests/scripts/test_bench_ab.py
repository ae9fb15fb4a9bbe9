"""scripts/bench_ab.py: the table logic on canned records, and the link tree
that makes each side import its own kvpool (no benchmark runs here)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ab.py"


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    if str(SCRIPT.parent) not in sys.path:  # bench_ab imports bench_host beside it
        sys.path.append(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_ab", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_ab"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _store(put_rate: float, put_p50: float, loop: float) -> list[dict[str, object]]:
    return [
        {"transport": "host", "op": "python_loop", "size": 0, "batch": 1, "gbps": 0.0,
         "ops_per_s": 1e6 / loop, "p50_us": loop, "p99_us": loop, "when": "start"},
        {"transport": "socket", "op": "xhost_write", "size": 4096, "batch": 1, "gbps": 0.1,
         "ops_per_s": 30000.0, "p50_us": 27.0, "p99_us": 50.0},
        {"transport": "socket", "op": "xhost_write", "size": 4096, "batch": 1, "gbps": 0.2,
         "ops_per_s": 46000.0, "p50_us": 39.0, "p99_us": 75.0},
        {"transport": "iperf3", "op": "xhost_write", "size": 16 << 20, "batch": 1, "gbps": 4.1,
         "ops_per_s": 0.0, "p50_us": 0.0, "p99_us": 0.0},
        {"transport": "tcp", "op": "batch_put_from", "size": 4096, "batch": 32, "gbps": 0.12,
         "ops_per_s": put_rate, "p50_us": put_p50, "p99_us": 2000.0,
         "client_cpu_us_per_key": 20.0, "host_steal_pct": 0.0},
        {"transport": "tcp", "op": "get_into", "size": 16 << 20, "batch": 1, "gbps": 2.0,
         "ops_per_s": 120.0, "p50_us": 7400.0, "p99_us": 8500.0},
    ]


def test_verdict_follows_the_metric_direction(ab: ModuleType) -> None:
    assert ab.verdict("ops_per_s", 100.0, 104.0, 0.05) == "within"
    assert ab.verdict("ops_per_s", 100.0, 94.0, 0.05) == "WORSE"
    assert ab.verdict("gbps", 2.0, 2.2, 0.05) == "better"
    assert ab.verdict("p50_us", 100.0, 94.0, 0.05) == "better"
    assert ab.verdict("p99_us", 100.0, 106.0, 0.05) == "WORSE"
    assert ab.verdict("rpc_p50_us", 100.0, 105.0, 0.05) == "within"
    assert ab.verdict("master_cpu_key_ops_per_s", 200e3, 150e3, 0.05) == "WORSE"
    assert ab.verdict("ops_per_s", None, 1.0, 0.05) == "missing"
    assert ab.verdict("something_new", 1.0, 2.0, 0.05) == "?"
    assert ab.verdict("cpu_us_per_call", 10.0, 12.0, 0.05) == "WORSE"


def test_client_cpu_records_compare_their_cpu(ab: ModuleType) -> None:
    """bench_client_cpu.py's records are compared by their CPU per call alone."""
    rec = {"transport": "client", "op": "get_into", "size": 4096, "batch": 1,
           "cpu_us_per_call": 7.5}
    assert ab.records_of([rec]) == [rec]
    assert ab.metrics_of(rec, "auto") == ["cpu_us_per_call"]


def test_records_of_each_benchmark_shape(ab: ModuleType) -> None:
    store = _store(30000.0, 1000.0, 20.0)
    assert ab.records_of(store) == store
    phases = [{"op": "put", "batch": 128, "keys": 1, "key_ops": 2, "wall_s": 1.0,
               "master_cpu_s": 0.5, "key_ops_per_s": 300000, "master_cpu_key_ops_per_s": 400000,
               "rpc_p50_us": 600.0}]
    quick = ab.records_of(phases)  # bench_master.py --quick's stdout
    assert quick == [{"transport": "master", "op": "put", "size": 0, "batch": 128,
                      "key_ops_per_s": 300000, "master_cpu_key_ops_per_s": 400000,
                      "rpc_p50_us": 600.0}]
    full = ab.records_of({"ops": phases, "python_loop_us_start": 18.5,
                          "memory": {"objects": 1000000, "rss_bytes_per_object": 300.0},
                          "snapshot": {"start_pause_ms": 1.0, "max_step_ms": 9.0, "other": 1}})
    assert [(r["transport"], r["op"]) for r in full] == [
        ("master", "put"), ("master", "rss"), ("master", "snapshot"), ("host", "python_loop")]
    assert full[2] == {"transport": "master", "op": "snapshot", "size": 0, "batch": 0,
                       "start_pause_ms": 1.0, "max_step_ms": 9.0}
    assert ab.records_of(None) == []
    assert ab.records_of({"targets": []}) == []


def test_summarize_medians_ratios_and_kinds(ab: ModuleType) -> None:
    bench = "bench_store.py --cross-host"
    runs = [
        ab.Run(bench, "base", 1, 0, 10.0, 20.0, _store(30000.0, 1000.0, 20.0)),
        ab.Run(bench, "head", 1, 0, 10.0, 20.0, _store(36000.0, 900.0, 20.0)),
        ab.Run(bench, "base", 2, 0, 10.0, 21.0, _store(32000.0, 1100.0, 21.0)),
        ab.Run(bench, "head", 2, 0, 10.0, 21.0, _store(38000.0, 950.0, 21.0)),
        ab.Run(bench, "base", 3, 0, 10.0, 19.0, _store(28000.0, 1050.0, 19.0)),
        ab.Run(bench, "head", 3, 1, 10.0, 19.0, []),  # a failed run counts for nothing
    ]
    rows = {(r.record, r.metric): r for r in ab.summarize(runs)}
    put = rows[("tcp batch_put_from 4K x32", "ops_per_s")]
    assert put.kind == "code"
    assert put.base == [30000.0, 32000.0, 28000.0] and put.head == [36000.0, 38000.0]
    assert put.base_median == 30000.0 and put.head_median == 37000.0
    assert put.ratio == pytest.approx(37000.0 / 30000.0)
    assert put.verdict(0.05) == "better"
    p50 = rows[("tcp batch_put_from 4K x32", "p50_us")]
    assert p50.base_median == 1050.0 and p50.head_median == 925.0
    assert p50.verdict(0.05) == "better" and p50.verdict(0.2) == "within"
    # 16 MiB is read in GB/s; the limits are shown, not judged; a repeated name is numbered
    assert ("tcp get_into 16M", "gbps") in rows and ("tcp get_into 16M", "ops_per_s") not in rows
    assert rows[("socket xhost_write 4K", "ops_per_s")].kind == "limit"
    assert rows[("socket xhost_write 4K #2", "ops_per_s")].base_median == 46000.0
    assert rows[("iperf3 xhost_write 16M", "gbps")].verdict(0.05) == "(limit)"
    assert ("iperf3 xhost_write 16M", "p50_us") not in rows  # 0: not measured
    loop = rows[("host python_loop (start)", "p50_us")]
    assert loop.kind == "machine" and loop.verdict(0.05) == "(machine)"
    assert ("host python_loop (start)", "ops_per_s") not in rows
    assert rows[("ab python_loop (before the run)", "p50_us")].head == [20.0, 21.0]
    every = {(r.record, r.metric) for r in ab.summarize(runs, "all")}
    assert ("tcp batch_put_from 4K x32", "client_cpu_us_per_key") in every
    assert ("tcp batch_put_from 4K x32", "host_steal_pct") in every
    named = {(r.record, r.metric) for r in ab.summarize(runs, ["p99_us"])}
    assert ("tcp batch_put_from 4K x32", "p99_us") in named
    assert all(m == "p99_us" or rec.startswith("ab ") for rec, m in named)

    table = ab.format_table(ab.summarize(runs), 0.05)
    lines = table.splitlines()
    assert lines[0] == f"### {bench}"
    judged = [i for i, line in enumerate(lines)
              if any(f"| {v} |" in line for v in ("better", "within", "WORSE"))]
    shown = [i for i, line in enumerate(lines) if "(limit) |" in line or "(machine) |" in line]
    assert judged and shown and max(judged) < min(shown)  # judged rows first
    assert "| tcp batch_put_from 4K x32 | ops_per_s | 30,000 [28,000-32,000] | " \
           "37,000 [36,000-38,000] | 1.233 | better | no |" in lines
    assert put.overlap is False and p50.overlap is False
    assert rows[("tcp get_into 16M", "gbps")].overlap is True


def test_bench_command_line(ab: ModuleType, tmp_path: Path) -> None:
    b = ab.Bench.parse("scripts/bench_store.py --sizes 4096 --transports 'shm'")
    assert b.script == "bench_store.py" and b.args == ("--sizes", "4096", "--transports", "shm")
    assert b.argv("py", tmp_path, tmp_path / "o.json") == [
        "py", str(tmp_path / "scripts" / "bench_store.py"), "--sizes", "4096", "--transports",
        "shm", "--json", str(tmp_path / "o.json")]
    t = ab.Bench.parse("bench_x.py --out={json} -q")
    assert t.argv("py", tmp_path, Path("/o.json"))[2:] == ["--out=/o.json", "-q"]


def test_link_tree_imports_that_trees_layers(ab: ModuleType, tmp_path: Path) -> None:
    """The link tree wins over the kvpool installed for this interpreter, for each
    layer of the tree's package-dir mapping."""
    tree = tmp_path / "tree"
    for folder in ("core", "store"):
        (tree / folder).mkdir(parents=True)
        (tree / folder / "__init__.py").write_text(f"WHERE = 'fake {folder}'\n")
    (tree / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "kvpool.core" = "core", "kvpool.store" = "store" }\n')
    pypath = ab.link_tree(tree, tmp_path / "py")
    env = dict(os.environ, PYTHONPATH=str(pypath))
    out = subprocess.run(
        [sys.executable, "-c", "import kvpool.core, kvpool.store; "
         "print(kvpool.core.WHERE, '/', kvpool.store.WHERE)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "fake core / fake store"
    # built again over the old one (a reused work directory)
    assert ab.link_tree(tree, tmp_path / "py") == pypath
    with pytest.raises(RuntimeError):
        ab.link_tree(tmp_path, tmp_path / "none")

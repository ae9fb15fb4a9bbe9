"""A bare election candidate process for the HA tests and bench_ha.py.

Runs one :class:`kvpool.master.ha.election.Elector` and, every few ms while
``may_acknowledge()`` holds, appends ``"<epoch> <time_ns>"`` to ``--acks``:
the moments it would have acknowledged a change. Each state change is
appended to ``--events`` as a JSON line. Two candidates whose ack intervals
overlap in time would be two leaders accepting writes.

    python -m support.ha_candidate --etcd HOST:PORT --cluster-id C --id A \\
        --acks FILE --events FILE [--sync-members B,C] [--ttl 2]

``--sync-members``: once elected, publish this in-sync set (others may then
not campaign). SIGTERM resigns (revokes the lease) and exits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Self

from kvpool.cluster.processes import ManagedProcess
from kvpool.core.etcd import MemberInfo, parse_etcd_url
from kvpool.master.ha.election import ElectionConfig, ElectionState, Elector, Role

__all__ = ["CandidateProcess", "acks_overlap"]


class CandidateProcess(ManagedProcess):
    """``python -m support.ha_candidate`` as a managed process; files in ``workdir``."""

    _what = "candidate"

    def __init__(self, etcd: str, cluster_id: str, instance_id: str, workdir: str,
                 sync_members: str | None = None, ttl: int = 2) -> None:
        super().__init__()
        self.instance_id = instance_id
        self.acks_path = os.path.join(workdir, f"{instance_id}.acks")
        self.events_path = os.path.join(workdir, f"{instance_id}.events")
        self.log_path = os.path.join(workdir, f"{instance_id}.log")
        self.args = ["--etcd", etcd, "--cluster-id", cluster_id, "--id", instance_id,
                     "--acks", self.acks_path, "--events", self.events_path, "--ttl", str(ttl)]
        if sync_members:
            self.args += ["--sync-members", sync_members]

    def start(self) -> Self:
        tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = tests_dir + os.pathsep + env.get("PYTHONPATH", "")
        self._spawn([sys.executable, "-m", "support.ha_candidate", *self.args], env=env)
        return self

    def pause(self) -> None:
        if self.running:
            os.kill(self._proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]

    def resume(self) -> None:
        if self.running:
            os.kill(self._proc.pid, signal.SIGCONT)  # type: ignore[union-attr]

    def stop(self, timeout_s: float = 15.0) -> int | None:
        self.resume()
        return super().stop(timeout_s)

    def events(self) -> list[dict[str, Any]]:
        try:
            with open(self.events_path) as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    def last(self) -> dict[str, Any]:
        ev = self.events()
        return ev[-1] if ev else {}

    def acks(self) -> list[tuple[int, int]]:
        """(epoch, time_ns) of every acknowledgment this candidate would have made."""
        try:
            with open(self.acks_path) as f:
                return [(int(a), int(b)) for a, b in (line.split() for line in f if line.strip())]
        except OSError:
            return []


def acks_overlap(candidates: list[CandidateProcess]) -> list[str]:
    """Epoch terms whose acknowledgment intervals overlap in time (must be empty),
    and epochs acknowledged by two candidates."""
    terms: dict[int, tuple[str, int, int]] = {}
    problems = []
    for c in candidates:
        for epoch, t in c.acks():
            if epoch in terms and terms[epoch][0] != c.instance_id:
                problems.append(f"epoch {epoch} acknowledged by {terms[epoch][0]} and "
                                f"{c.instance_id}")
                continue
            who, lo, hi = terms.get(epoch, (c.instance_id, t, t))
            terms[epoch] = (who, min(lo, t), max(hi, t))
    ordered = sorted(terms.items(), key=lambda kv: kv[1][1])
    for (e1, (w1, _l1, h1)), (e2, (w2, l2, _h2)) in itertools.pairwise(ordered):
        if l2 <= h1:
            problems.append(f"epoch {e1} ({w1}) acked until {h1}, epoch {e2} ({w2}) from {l2}")
        if e2 <= e1:
            problems.append(f"epoch went from {e1} to {e2}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--cluster-id", default="default")
    ap.add_argument("--id", required=True)
    ap.add_argument("--acks", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--sync-members", default=None)
    ap.add_argument("--ttl", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    target = parse_etcd_url(args.etcd, args.cluster_id)
    cfg = ElectionConfig(target.endpoints, target.cluster_id, lease_ttl_s=args.ttl)
    me = MemberInfo(args.id, f"127.0.0.1:{10000 + os.getpid() % 50000}")
    elector = Elector(cfg, me)
    events = open(args.events, "a", buffering=1)
    published: set[int] = set()

    def changed(st: ElectionState) -> None:
        events.write(json.dumps({"role": st.role.value, "epoch": st.epoch,
                                 "leader": st.leader.instance_id if st.leader else None,
                                 "eligible": st.eligible, "t": time.time()}) + "\n")

    elector.on_change(changed)
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    elector.start()
    acks = os.open(args.acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while not stop:
        st = elector.state()
        if st.role is Role.LEADER and args.sync_members and st.epoch not in published:
            try:
                elector.set_sync_set(tuple(args.sync_members.split(",")), False)
                published.add(st.epoch)
            except Exception as exc:
                logging.warning("sync set: %s", exc)
        # the time is read before the check: a stop between the two then shows
        # an earlier time, never a later one than the check that passed
        t = time.time_ns()
        epoch = elector.epoch
        if elector.may_acknowledge():
            os.write(acks, f"{epoch} {t}\n".encode())
        time.sleep(0.005)
    elector.close(resign=True)
    events.write(json.dumps({"role": "stopped", "t": time.time()}) + "\n")


if __name__ == "__main__":
    main()

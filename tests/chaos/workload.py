"""Workload agent of the chaos suite, run inside a network namespace.

``python workload.py agent --master ADDR:PORT --host-id wl1 --bind-host ADDR``
opens a :class:`kvpool.store.Client` (a pure client: no memory of its own)
and answers JSON commands, one per stdin line, with one JSON line on stdout:

- ``{"cmd": "segments"}`` -> ``{"segments": [{segment_id, host_id, state, ...}]}``
- ``{"cmd": "put", "keys": [...], "replica_num": 1, "preferred": []}``
  -> ``{"codes": {key: code}}`` (0 = stored)
- ``{"cmd": "get", "keys": [...], "seconds": 0}`` -> ``{"gets": [[key, code,
  t_wall_start, elapsed_s, wrong], ...]}``; loops over the keys for
  ``seconds`` (one pass when 0). ``wrong`` is true when the bytes returned
  differ from the value put (a failure, however rare).
- ``{"cmd": "groups", "groups": {name: keys}, "seconds": S}`` -> ``{"groups":
  {name: gets}}``: one thread per group, concurrently, same client.
- ``{"cmd": "replicas", "keys": [...]}`` -> ``{"replicas": {key: [segment_id]
  | code}}``
- ``{"cmd": "quit"}``

Values are derived from the key (``k/<tag>/<i>/<size>``), so any process can
check any value: every get is compared by sha256 with the expected bytes.

``python workload.py probe ADDR:PORT TIMEOUT_S`` pings the master until it
answers (exit 0) or the timeout passes (exit 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import threading
import time
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode, KVPoolError

log = logging.getLogger("chaos.workload")

WRONG_BYTES = 1  # the "code" of a get that returned bytes other than the ones put


def make_key(tag: str, i: int, size: int) -> str:
    return f"k/{tag}/{i}/{size}"


def value_for(key: str) -> bytes:
    """The value stored under ``key``: ``size`` pseudo-random bytes seeded by the key."""
    size = int(key.rsplit("/", 1)[1])
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return np.random.default_rng(seed).bytes(size)


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


class Agent:
    def __init__(self, client: Any) -> None:
        self.client = client
        self._expected: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def expected_digest(self, key: str) -> bytes:
        with self._lock:
            d = self._expected.get(key)
        if d is None:
            d = _digest(value_for(key))
            with self._lock:
                self._expected[key] = d
        return d

    def get_once(self, key: str) -> list[Any]:
        expected = self.expected_digest(key)
        t_wall, t0 = time.time(), time.monotonic()
        try:
            data = self.client.get(key)
            wrong = _digest(data) != expected
            code = WRONG_BYTES if wrong else 0
        except KVPoolError as exc:
            code, wrong = int(exc.code), False
            log.info("get %s: %s", key, exc)
        except Exception as exc:  # any other failure is still a failure, never a hang
            code, wrong = int(ErrorCode.INTERNAL_ERROR), False
            log.exception("get %s: unexpected %s", key, exc)
        return [key, code, t_wall, time.monotonic() - t0, wrong]

    def get_loop(self, keys: list[str], seconds: float) -> list[list[Any]]:
        out: list[list[Any]] = []
        deadline = time.monotonic() + seconds
        while True:
            for k in keys:
                out.append(self.get_once(k))
            if time.monotonic() >= deadline:
                return out

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        cmd = msg.get("cmd")
        if cmd == "segments":
            segs = self.client.list_segments()
            return {"segments": [{"segment_id": s.descriptor.segment_id,
                                  "host_id": s.descriptor.host_id,
                                  "endpoint": s.descriptor.endpoint,
                                  "client_id": s.descriptor.client_id,
                                  "used": s.used, "capacity": s.capacity,
                                  "state": s.state} for s in segs]}
        if cmd == "put":
            from kvpool.store import ReplicateConfig

            cfg = ReplicateConfig(replica_num=int(msg.get("replica_num", 1)),
                                  preferred_segments=list(msg.get("preferred", [])))
            codes: dict[str, int] = {}
            for k in msg["keys"]:
                try:
                    self.client.put(k, value_for(k), cfg)
                    codes[k] = 0
                except KVPoolError as exc:
                    codes[k] = int(exc.code)
                    log.info("put %s: %s", k, exc)
            return {"codes": codes}
        if cmd == "get":
            return {"gets": self.get_loop(list(msg["keys"]), float(msg.get("seconds", 0)))}
        if cmd == "groups":
            results: dict[str, list[list[Any]]] = {}
            seconds = float(msg.get("seconds", 0))

            def run(name: str, keys: list[str]) -> None:
                results[name] = self.get_loop(keys, seconds)

            threads = [threading.Thread(target=run, args=(n, list(ks)))
                       for n, ks in msg["groups"].items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return {"groups": results}
        if cmd == "replicas":
            reps: dict[str, Any] = {}
            for k in msg["keys"]:
                try:
                    reps[k] = self.client.replica_segments(k)
                except KVPoolError as exc:
                    reps[k] = int(exc.code)
            return {"replicas": reps}
        if cmd == "ping":
            return {"ok": True}
        raise ValueError(f"unknown command {cmd!r}")


def agent_main(args: argparse.Namespace) -> int:
    from kvpool.store import Client, ClientConfig

    cfg = ClientConfig(master_address=args.master, memory_size=0, host_id=args.host_id,
                       bind_host=args.bind_host, rpc_timeout_s=args.rpc_timeout_s,
                       transfer_timeout_s=args.transfer_timeout_s, ping_interval_s=0.5,
                       checksum="crc32")
    if hasattr(cfg, "curve"):  # the chaos suite tests faults, not authentication
        from kvpool.core.auth import CurveConfig

        cfg.curve = CurveConfig(enabled=False)
    out = sys.stdout
    with Client(cfg) as client:
        agent = Agent(client)
        out.write(json.dumps({"ready": True, "client_id": client.client_id}) + "\n")
        out.flush()
        for line in sys.stdin:
            if not line.strip():
                continue
            msg = json.loads(line)
            if msg.get("cmd") == "quit":
                break
            try:
                reply = agent.handle(msg)
            except Exception as exc:
                log.exception("command %s failed", msg.get("cmd"))
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    return 0


def probe_main(address: str, timeout_s: float) -> int:
    from kvpool.core.protocol import Ping
    from kvpool.core.rpc_client import MasterClient, MasterRPCError

    deadline = time.monotonic() + timeout_s
    with MasterClient(address, timeout_s=0.5) as mc:
        while time.monotonic() < deadline:
            try:
                mc.call(Ping(client_id="chaos-probe"))
                return 0
            except MasterRPCError:
                time.sleep(0.1)
    return 1


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("agent")
    a.add_argument("--master", required=True)
    a.add_argument("--host-id", required=True)
    a.add_argument("--bind-host", required=True)
    a.add_argument("--rpc-timeout-s", type=float, default=2.0)
    a.add_argument("--transfer-timeout-s", type=float, default=4.0)
    pr = sub.add_parser("probe")
    pr.add_argument("address")
    pr.add_argument("timeout_s", type=float)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.mode == "probe":
        return probe_main(args.address, args.timeout_s)
    return agent_main(args)


if __name__ == "__main__":
    sys.exit(main())

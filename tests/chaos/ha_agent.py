"""Client-side processes of the HA partition scenario, run inside network namespaces.

Every mode prints JSON lines on stdout; times are ``time.monotonic()``
(CLOCK_MONOTONIC: one clock for every process of the machine, whatever its
namespace), so the test can order events seen by different processes.

``python ha_agent.py watch URL``
    follows a master group's leader through etcd; one line per change
    ``{"t", "leader", "epoch"}`` (``leader`` null while none leads).

``python ha_agent.py write URL BIND_HOST``
    a store client (no memory of its own) putting ``k/w/<i>/<size>`` keys back
    to back; prints ``{"ready": true}``, then per put ``{"put": key, "t0",
    "t1", "ok", "code", "addr", "epoch"}`` (``addr``/``epoch``: the leader
    the client's stub sent the put's last call to). On the stdin line
    ``stop`` it finishes the put in flight and prints ``{"stopped": true}``;
    then ``{"cmd": "verify", "keys": [...], "exist": [...]}`` gets every key
    of ``keys`` and compares its bytes with the value put, and asks EXIST for
    every key of ``exist``: ``{"bad": [[key, why]...], "missing": [...]}``.

``python ha_agent.py probe ADDR TIMEOUT_S``
    a master RPC stub addressing one instance directly (no etcd): writes
    ``p/<i>`` objects (PUT_START + PUT_END, no bytes: the master's state is
    what is probed) back to back, each call with ``TIMEOUT_S``; one line per
    attempt ``{"probe": key, "t0", "t1", "ok", "code", "stage"}`` until the
    stdin line ``stop``, then ``{"stopped": true}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger("chaos.ha_agent")

_out_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def value_for(key: str) -> bytes:
    """The bytes stored under ``k/<tag>/<i>/<size>``: derived from the key."""
    size = int(key.rsplit("/", 1)[1])
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _wait_stop(stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


def watch_main(url: str) -> int:
    from kvpool.core.etcd import LeaderInfo, LeaderResolver

    def changed(leader: LeaderInfo | None) -> None:
        emit({"t": time.monotonic(), "leader": leader.address if leader else None,
              "epoch": leader.epoch if leader else 0})

    resolver = LeaderResolver(url, timeout_s=0.5)
    resolver.on_change(changed)
    first = resolver.current()
    changed(first)
    for _ in sys.stdin:  # runs until stdin closes
        pass
    resolver.close()
    return 0


def write_main(url: str, bind_host: str) -> int:
    from kvpool.core.auth import CurveConfig
    from kvpool.core.errors import KVPoolError
    from kvpool.core.protocol import Exist
    from kvpool.store import Client, ClientConfig

    cfg = ClientConfig(master_address=url, memory_size=0, host_id="writer",
                       bind_host=bind_host, rpc_timeout_s=2.0, transfer_timeout_s=3.0,
                       curve=CurveConfig(enabled=False))
    stop = threading.Event()
    with Client(cfg) as client:
        emit({"ready": True})
        threading.Thread(target=_wait_stop, args=(stop,), daemon=True).start()
        i = 0
        while not stop.is_set():
            key = f"k/w/{i}/{1024 + (i * 797) % 20000}"
            i += 1
            t0 = time.monotonic()
            try:
                client.put(key, value_for(key))
                ok, code = True, 0
            except KVPoolError as exc:
                ok, code = False, int(exc.code)
                log.info("put %s: %s", key, exc)
            stub = client._parts.session.stub()  # the stub this thread's calls went through
            emit({"put": key, "t0": t0, "t1": time.monotonic(), "ok": ok, "code": code,
                  "addr": stub.address.split("://")[-1], "epoch": stub._epoch})
            if not ok:
                time.sleep(0.02)
        emit({"stopped": True})
        for line in sys.stdin:
            if not line.strip():
                continue
            msg = json.loads(line)
            if msg.get("cmd") != "verify":
                break
            bad: list[list[str]] = []
            for key in msg["keys"]:
                try:
                    if client.get(key) != value_for(key):
                        bad.append([key, "wrong bytes"])
                except KVPoolError as exc:
                    bad.append([key, str(exc)])
            call = client._parts.session.call
            missing = [k for k in msg["exist"] if not call(Exist(key=k)).exists]
            emit({"bad": bad, "missing": missing})
    return 0


def probe_main(address: str, timeout_s: float) -> int:
    from kvpool.core.protocol import PutEnd, PutStart
    from kvpool.core.rpc_client import MasterClient, MasterRPCError

    stop = threading.Event()
    threading.Thread(target=_wait_stop, args=(stop,), daemon=True).start()
    with MasterClient(address, timeout_s=timeout_s) as mc:
        i = 0
        while not stop.is_set():
            key = f"p/{i}"
            i += 1
            t0 = time.monotonic()
            stage = "start"
            try:
                mc.call(PutStart(client_id="prober", key=key, size=4096))
                stage = "end"
                mc.call(PutEnd(client_id="prober", key=key))
                ok, code = True, 0
            except MasterRPCError as exc:
                ok, code = False, int(exc.code)
                log.info("probe %s (%s): %s", key, stage, exc)
            emit({"probe": key, "t0": t0, "t1": time.monotonic(), "ok": ok, "code": code,
                  "stage": stage})
            if not ok:
                time.sleep(0.05)
    emit({"stopped": True})
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode, *args = sys.argv[1:]
    if mode == "watch":
        return watch_main(args[0])
    if mode == "write":
        return write_main(args[0], args[1])
    if mode == "probe":
        return probe_main(args[0], float(args[1]))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())

"""A process that owns a segment, for the lifecycle and liveness tests.

``python lifecycle_holder.py --master ADDR --mode MODE [--keys N] [--no-guard]``
sets up a :class:`kvpool.store.Client` contributing ``--memory`` bytes, puts
``--keys`` objects (``k{i}`` -> ``value(i, --size)``), prints one JSON line
``{pid, client_id, segment_ids, shm_names, guard_pid}`` and then, by mode:

- ``wait``: blocks reading stdin (for signals; EOF ends it cleanly);
- ``close`` / ``drop``: after one stdin line, ``close()`` / ``del`` the
  client (no close), prints ``{"released": true}``, then blocks like
  ``wait`` (the process lives on);
- ``mooncake-drop``: the same client made through ``MooncakeDistributedStore``
  (the way SGLang uses it), dropped without ``close()``;
- ``exit``: after one stdin line, returns: the interpreter exits with the
  client open;
- ``commands``: one command per stdin line, one JSON reply each:
  ``busy S`` (pure-Python loops for S seconds), ``gil S`` (one C call that
  holds the GIL for S seconds), ``state`` (remount count), ``quit``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any


def value(i: int, size: int = 4096) -> bytes:
    seed = hashlib.sha256(f"v{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _out(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hold_gil(seconds: float) -> None:
    """poll(NULL, 0, ms) through PyDLL: a C call that keeps the GIL throughout."""
    libc = ctypes.PyDLL(ctypes.util.find_library("c"))
    libc.poll(None, 0, int(seconds * 1000))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--memory", type=int, default=8 << 20)
    ap.add_argument("--keys", type=int, default=4)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--ping-interval", type=float, default=1.0)
    ap.add_argument("--no-guard", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from kvpool.store import Client, ClientConfig, MooncakeDistributedStore

    store: Any = None
    if args.mode == "mooncake-drop":
        store = MooncakeDistributedStore()
        rc = store.setup("localhost", "P2PHANDSHAKE", args.memory, 16 << 20, "tcp", "",
                         args.master)
        assert rc == 0, rc
        client = store._client
    else:
        client = Client(ClientConfig(master_address=args.master, memory_size=args.memory,
                                     ping_interval_s=args.ping_interval,
                                     guard=not args.no_guard)).setup()
    for i in range(args.keys):
        client.put(f"k{i}", value(i, args.size))
    guard = client.segment_host.guard
    _out({"pid": os.getpid(), "client_id": client.client_id,
          "segment_ids": client.segment_ids, "shm_names": client.shm_names,
          "guard_pid": guard.pid if guard is not None else None})
    if args.mode in ("close", "drop", "mooncake-drop", "exit"):
        sys.stdin.readline()  # the test has looked at the segment: go
    if args.mode == "exit":
        return 0
    if args.mode == "close":
        client.close()
    elif args.mode in ("drop", "mooncake-drop"):
        del client, guard, store
        gc.collect()
    if args.mode in ("close", "drop", "mooncake-drop"):
        _out({"released": True})
    if args.mode == "commands":
        for line in sys.stdin:
            cmd, *rest = line.split()
            if cmd == "busy":
                end = time.monotonic() + float(rest[0])
                n = 0
                while time.monotonic() < end:
                    n += sum(range(2000))  # pure Python: the GIL changes hands
                _out({"busy": True})
            elif cmd == "gil":
                _hold_gil(float(rest[0]))
                _out({"gil": True})
            elif cmd == "state":
                _out({"remounts": client.remount_count})
            elif cmd == "quit":
                client.close()
                return 0
        return 0
    sys.stdin.read()  # until EOF (or a signal)
    return 0


if __name__ == "__main__":
    sys.exit(main())

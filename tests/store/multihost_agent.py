"""A Mooncake-compatible store in its own process, driven by JSON lines on stdin.

Run inside a network namespace by tests/store/test_multihost.py. Each request
is one JSON object with ``op``; each reply one JSON object on stdout:

- ``setup`` {form: "positional"|"dict", local_hostname, master, segment,
  extra: {...}} -> {rc, hostname}
- ``put`` {key, seed, size, preferred?} -> {rc}   (bytes from the seed)
- ``get`` {key} -> {n, sha}                        (sha256 of what was read)
- ``put_multi`` / ``get_multi`` {keys, seed, parts, part_size, preferred?}
  -> {rc: [...]} / {rc: [...], sha: [...]}        (batch multi-buffer calls)
- ``stats`` -> the master's STATS; ``close`` -> {rc} and the agent exits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from typing import Any

import msgspec
import numpy as np

from kvpool.store.mooncake import MooncakeDistributedStore, ReplicateConfig


def payload(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    store = MooncakeDistributedStore()
    keep: list[np.ndarray] = []
    for line in sys.stdin:
        req: dict[str, Any] = json.loads(line)
        op = req["op"]
        out: dict[str, Any]
        if op == "setup":
            if req["form"] == "dict":
                conf = {"local_hostname": req["local_hostname"], "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": str(req["segment"]), "local_buffer_size": "16MB",
                        "protocol": "tcp", "master_server_address": req["master"],
                        **req.get("extra", {})}
                rc = store.setup(conf)
            else:
                rc = store.setup(req["local_hostname"], "P2PHANDSHAKE", int(req["segment"]),
                                 16 << 20, "tcp", "", req["master"])
            out = {"rc": rc, "hostname": store.get_hostname()}
        elif op in ("put", "put_multi"):
            cfg = ReplicateConfig()
            if req.get("preferred"):
                cfg.preferred_segment = req["preferred"]
            if op == "put":
                out = {"rc": store.put(req["key"], payload(req["seed"], req["size"]), cfg)}
            else:
                ptrs, sizes = [], []
                for i, _key in enumerate(req["keys"]):
                    parts = [payload(req["seed"] + i * 100 + j, req["part_size"])
                             for j in range(req["parts"])]
                    keep.extend(parts)
                    ptrs.append([int(p.ctypes.data) for p in parts])
                    sizes.append([p.nbytes for p in parts])
                out = {"rc": store.batch_put_from_multi_buffers(req["keys"], ptrs, sizes, cfg)}
        elif op == "get":
            data = store.get(req["key"])
            out = {"n": len(data), "sha": hashlib.sha256(data).hexdigest()}
        elif op == "get_multi":
            bufs = [[np.zeros(req["part_size"], np.uint8) for _ in range(req["parts"])]
                    for _ in req["keys"]]
            rc = store.batch_get_into_multi_buffers(
                req["keys"], [[int(b.ctypes.data) for b in bs] for bs in bufs],
                [[b.nbytes for b in bs] for bs in bufs])
            out = {"rc": rc, "sha": [hashlib.sha256(b"".join(b.tobytes() for b in bs)).hexdigest()
                                     for bs in bufs]}
        elif op == "stats":
            out = msgspec.structs.asdict(store._c().stats())
        elif op == "close":
            print(json.dumps({"rc": store.close()}), flush=True)
            return 0
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out, default=str), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny TCP probe run inside a namespace by the chaos infrastructure tests.

``python netprobe.py serve HOST PORT``: accept connections forever; each
request is an 8-byte big-endian length + payload; the reply is the payload's
length (8 bytes) and sha256 (32 bytes). Prints ``READY`` once listening.

``python netprobe.py send HOST PORT NBYTES TIMEOUT_S``: send NBYTES random
bytes, check the reply, print one JSON line ``{ok, seconds, error}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _handle(conn: socket.socket) -> None:
    with conn:
        try:
            (n,) = struct.unpack(">Q", _recv_exact(conn, 8))
            digest = hashlib.sha256(_recv_exact(conn, n)).digest()
            conn.sendall(struct.pack(">Q", n) + digest)
        except (OSError, ConnectionError):
            pass


def serve(host: str, port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(16)
    print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def send(host: str, port: int, nbytes: int, timeout_s: float) -> dict[str, object]:
    payload = os.urandom(nbytes)
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(max(0.01, timeout_s - (time.monotonic() - t0)))
            conn.sendall(struct.pack(">Q", nbytes) + payload)
            reply = _recv_exact(conn, 40)
        ok = reply == struct.pack(">Q", nbytes) + hashlib.sha256(payload).digest()
        return {"ok": ok, "seconds": time.monotonic() - t0,
                "error": None if ok else "reply does not match"}
    except OSError as exc:
        return {"ok": False, "seconds": time.monotonic() - t0,
                "error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                              float(sys.argv[5]))), flush=True)

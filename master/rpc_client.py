"""Client-side RPC stub for the master (used by the store, tooling and tests).

Thread-safe: one DEALER socket guarded by a lock; every call has a timeout.
A timed-out call closes and recreates the socket so a late reply can never be
taken as the answer to a later request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import zmq

from kvpool.master.errors import ErrorCode, KVPoolError
from kvpool.master.protocol import Op, decode_frame, encode_frame

__all__ = ["MasterClient", "MasterRPCError"]

log = logging.getLogger(__name__)


class MasterRPCError(KVPoolError):
    """An op failed at the master (``code`` is the master's error code) or the
    master could not be reached (RPC_FAIL / RPC_TIMEOUT)."""


def normalize_address(address: str) -> str:
    """Accept ``host:port``, ``tcp://host:port`` or ``ipc://path``."""
    if "://" in address:
        return address
    return f"tcp://{address}"


class MasterClient:
    """Synchronous RPC stub: ``call(op, **args) -> result dict``.

    Raises :class:`MasterRPCError` with the master's code for an error reply,
    ``RPC_TIMEOUT`` when no reply arrives within ``timeout_s``.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        context: zmq.Context | None = None,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.address = normalize_address(address)
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._curve_server_key = curve_server_key
        self._curve_keypair = curve_keypair
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._closed = False

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve_server_key is not None:
                if self._curve_keypair is None:
                    pub, sec = zmq.curve_keypair()
                else:
                    pub, sec = self._curve_keypair
                sock.curve_serverkey = self._curve_server_key
                sock.curve_publickey = pub
                sock.curve_secretkey = sec
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def call(self, op: Op, timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one op and wait for its reply; return ``result`` (a dict)."""
        if self._closed:
            raise MasterRPCError("master client is closed", ErrorCode.CLOSED)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            req_id = next(self._ids)
            sock = self._socket()
            try:
                sock.send(encode_frame({"op": int(op), "id": req_id, "args": args}), zmq.NOBLOCK)
            except zmq.Again as exc:
                self._reset()
                raise MasterRPCError(
                    f"cannot send to master {self.address}", ErrorCode.RPC_FAIL
                ) from exc
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    self._reset()
                    raise MasterRPCError(
                        f"{op.name}: no reply from master {self.address} within {timeout:.1f}s",
                        ErrorCode.RPC_TIMEOUT,
                    )
                frames = sock.recv_multipart()
                reply = decode_frame(frames[-1])
                if not isinstance(reply, dict) or reply.get("id") != req_id:
                    continue  # a stale reply to an earlier, timed-out request
                break
        code = int(reply.get("code", ErrorCode.INTERNAL_ERROR))
        if code != ErrorCode.OK:
            raise MasterRPCError(f"{op.name}: {reply.get('error', '')}", code)
        result = reply.get("result")
        return result if isinstance(result, dict) else {}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._reset()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

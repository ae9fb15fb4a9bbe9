"""Capabilities and CURVE (docs/security.md) end to end, real processes on
loopback: a master, ``kvpool client`` node daemons (their transfer servers
verify capabilities) and raw ZeroMQ peers that try forged, expired, widened,
wrong-op, missing and replayed-for-another-segment capabilities; CURVE on a
daemon's transfer server keeps unauthenticated peers out entirely."""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess, find_free_port
from kvpool.core.auth import CurveConfig, save_keypair
from kvpool.core.capability import DenyReason
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import GetReplicaList, GetSegments, decode_frame, encode_frame
from kvpool.store import Client, ClientConfig, ReplicateConfig
from kvpool.transfer import TransferEngine, TransferOp, TransferRequest, load_transfer_config

READ, WRITE, STATS = int(TransferOp.READ), int(TransferOp.WRITE), 4
_ids = itertools.count(1)


class RawPeer:
    """A bare DEALER speaking the transfer server's wire protocol."""

    def __init__(self, endpoint: str, curve_server_key: bytes | None = None,
                 curve_keypair: tuple[bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            pub, sec = curve_keypair or zmq.curve_keypair()
            self.sock.curve_serverkey = curve_server_key
            self.sock.curve_publickey = pub
            self.sock.curve_secretkey = sec
        self.sock.connect(endpoint)

    def call(self, op: int, seg: str = "", off: int = 0, n: int = 0, cap: bytes = b"",
             payload: bytes | None = None, timeout_s: float = 5.0) -> tuple[dict[str, Any], bytes]:
        rid = next(_ids)
        hdr = encode_frame({"op": op, "id": rid, "seg": seg, "off": off, "len": n, "cap": cap})
        # a peer that fails the CURVE handshake never gets a usable pipe: even
        # sending would block, so wait for POLLOUT with the same deadline
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise TimeoutError("cannot send")
        try:
            self.sock.send_multipart([hdr] if payload is None else [hdr, payload], zmq.NOBLOCK)
        except zmq.Again:  # the pipe went away between poll and send (handshake refused)
            raise TimeoutError("cannot send") from None
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply")
        frames = self.sock.recv_multipart()
        rep = decode_frame(frames[0])
        assert rep["id"] == rid
        return rep, (frames[1] if len(frames) > 1 else b"")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[MasterProcess, list[NodeDaemonProcess], Path]]:
    mcfg = tmp_path / "master.yaml"
    mcfg.write_text("capability_ttl_ms: 1500\n")  # short grants: the expiry case stays fast
    ccfg = tmp_path / "client.yaml"
    ccfg.write_text("transfer_overrides:\n  server:\n    capability_leeway_ms: 0\n")
    with MasterProcess(data_dir=str(tmp_path / "m"), extra_args=["--config", str(mcfg)]) as m:
        metrics = ["--metrics-port", str(find_free_port())]
        ds = [NodeDaemonProcess(m.address, "16MiB", host_id=f"node{i}",
                                extra_args=["--config", str(ccfg), *(metrics if i == 0 else [])],
                                log_dir=str(tmp_path / f"d{i}")) for i in range(2)]
        try:
            for d in ds:
                d.start()
            yield m, ds, ccfg
        finally:
            for d in ds:
                d.stop()


def _replica(m: MasterProcess, key: str) -> tuple[str, int, int, int, bytes]:
    """(segment, offset, length, status, READ token) of the key's first replica."""
    with m.client() as mc:
        g = mc.call(GetReplicaList(key=key))
    r = g.replicas[0]
    return r.segment_id, r.offset, r.length, int(r.status), g.caps[r.cap]


def test_transfer_server_refuses_bad_capabilities(
        cluster: tuple[MasterProcess, list[NodeDaemonProcess], Path]) -> None:
    m, (a, b), _ = cluster
    seg_a, seg_b = a.segment_ids[0], b.segment_ids[0]
    value = bytes(range(256)) * 16
    cfg = ClientConfig(master_address=m.address, host_id="tester", checksum="crc32")
    with Client(cfg) as c:  # a pure client on another "host": every byte goes over tcp
        c.put("ka", value, ReplicateConfig(preferred_segments=[seg_a]))
        c.put("kb", b"x" * 100, ReplicateConfig(preferred_segments=[seg_b]))
        assert c.get("ka") == value  # legitimate reads carry valid capabilities
        peer = RawPeer(a.info["endpoint"])
        try:
            sid, off, n, _st, tok = _replica(m, "ka")
            assert sid == seg_a and n == len(value) and tok
            rep, data = peer.call(READ, seg_a, off, n, tok)
            assert rep["code"] == 0 and data == value  # the real grant works raw too

            def denied(*args: Any, **kw: Any) -> str:
                rep, _ = peer.call(*args, **kw)
                assert rep["code"] == ErrorCode.PERMISSION_DENIED, rep
                return str(rep["err"])

            assert "missing" in denied(READ, seg_a, off, n, b"")
            forged = tok[:-1] + bytes([tok[-1] ^ 1])
            assert "forged" in denied(READ, seg_a, off, n, forged)
            assert "out_of_range" in denied(READ, seg_a, off, n + 1, tok)  # widened
            assert "out_of_range" in denied(READ, seg_a, off + 64, n, tok)  # shifted
            assert "wrong_op" in denied(WRITE, seg_a, off, n, tok, payload=b"\0" * n)
            _, _, _, _, tok_b = _replica(m, "kb")  # a valid grant for node1's segment
            assert "wrong_segment" in denied(READ, seg_a, off, 100, tok_b)
            assert "malformed" in denied(READ, seg_a, off, n, b"garbage")
            time.sleep(1.6)  # past the grant's 1.5 s lifetime (leeway 0 in this cluster)
            assert "expired" in denied(READ, seg_a, off, n, tok)
            stats, _ = peer.call(STATS)
            refusals = stats["stats"]["capability_refusals"]
            for reason in (DenyReason.MISSING, DenyReason.FORGED, DenyReason.OUT_OF_RANGE,
                           DenyReason.WRONG_OP, DenyReason.WRONG_SEGMENT,
                           DenyReason.MALFORMED, DenyReason.EXPIRED):
                assert refusals[reason.value] >= 1, (reason, refusals)
            assert stats["stats"]["capability_accepted"] >= 2
            # ... and on the daemon's Prometheus endpoint (kvpool client --metrics-port)
            port = a.extra_args[a.extra_args.index("--metrics-port") + 1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            for reason, n in refusals.items():
                if n:
                    assert f'kvpool_capability_refusals_total{{reason="{reason}"}} {float(n)}' \
                        in text, (reason, text)
            # ... and its JSON /health: what it contributes, and for how long
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                assert r.headers["Content-Type"] == "application/json"
                health = json.loads(r.read())
            assert health["segment_ids"] == a.segment_ids and health["uptime_s"] > 0, health
        finally:
            peer.close()
        # the refused WRITE changed nothing, and the server still serves
        assert c.get("ka") == value


def test_engine_without_capability_cannot_read_or_write(
        cluster: tuple[MasterProcess, list[NodeDaemonProcess], Path]) -> None:
    m, (a, _b), _ = cluster
    seg_a = a.segment_ids[0]
    with Client(ClientConfig(master_address=m.address, host_id="tester")) as c:
        c.put("k", b"v" * 4096, ReplicateConfig(preferred_segments=[seg_a]))
        off = _replica(m, "k")[1]
        with m.client() as mc:
            desc = mc.call(GetSegments(segment_ids=[seg_a])).segments[seg_a]
        eng = TransferEngine(load_transfer_config(), host_id="intruder")
        try:
            eng.add_peer_segment(desc)
            buf = bytearray(4096)
            for op, b in ((TransferOp.READ, buf), (TransferOp.WRITE, b"X" * 4096)):
                st = eng.transfer([TransferRequest(op, b, seg_a, off, 4096)], timeout=10)
                assert not st[0].ok and st[0].code == ErrorCode.PERMISSION_DENIED, st[0]
            assert buf == bytearray(4096)
        finally:
            eng.close()
        assert c.get("k") == b"v" * 4096


def test_curve_on_transfer_server_keeps_unauthenticated_peers_out(tmp_path: Path) -> None:
    _, secret = save_keypair(tmp_path / "keys", "cluster")
    curve = CurveConfig(enabled=True, secret_key_file=str(secret))
    flags = ["--curve", "on", "--curve-key", str(secret)]
    with MasterProcess(curve_key=str(secret)) as m, \
            NodeDaemonProcess(m.address, "16MiB", host_id="node0", extra_args=flags,
                              log_dir=str(tmp_path / "d0")) as d:
        endpoint = d.info["endpoint"]
        server_pub = curve.server_public_key()
        for peer in (RawPeer(endpoint),  # plain ZeroMQ: the handshake never completes
                     RawPeer(endpoint, server_pub)):  # CURVE with a key not allowed
            try:
                with pytest.raises(TimeoutError):
                    peer.call(3, timeout_s=1.0)  # even PING gets nothing
            finally:
                peer.close()
        cfg = ClientConfig(master_address=m.address, host_id="tester", curve=curve)
        with Client(cfg) as c:  # the cluster key: CURVE to master and transfer server
            c.put("k", b"secret bytes" * 100)
            assert c.get("k") == b"secret bytes" * 100
        kp = curve.keypair()
        peer = RawPeer(endpoint, server_pub, (kp.public, kp.secret))
        try:
            rep, _ = peer.call(4)
            assert rep["code"] == 0 and rep["stats"]["curve"] is True
            assert rep["stats"]["curve_denied"] >= 1  # the wrong-key handshake above
        finally:
            peer.close()


def test_shm_segments_are_owner_only(
        cluster: tuple[MasterProcess, list[NodeDaemonProcess], Path]) -> None:
    """The shm trust boundary: only the same user on the same host maps a segment."""
    import os
    import stat

    _, (a, _b), _ = cluster
    for name in a.info["shm_names"]:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{name.lstrip('/')}").st_mode)
        assert mode == 0o600, oct(mode)

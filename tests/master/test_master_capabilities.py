"""Capabilities on a real ``kvpool master`` process: segment keys at mount, signed
READ/WRITE capabilities in (batch) put_start / get_replica_list (one token
per segment and batch, covering exactly the granted ranges), keys
persisted across a kill -9 (data dir 0700, key file 0600), and the
per-connection in-flight bound (TOO_MANY_REQUESTS)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from kvpool.cluster.processes import MasterProcess
from kvpool.core.capability import CapabilityError, CapOp, DenyReason, verify
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutStart,
    Exist,
    GetReplicaList,
    MountSegment,
    PutEnd,
    PutOptions,
    PutStart,
    Stats,
    UnmountSegment,
    decode_reply,
    encode_request,
)
from kvpool.core.rpc_client import MasterClient
from support.factories import segment_desc


def _mount(c: MasterClient, sid: str, client_id: str = "c1") -> bytes:
    r = c.call(MountSegment(client_id=client_id, segment=segment_desc(sid, client_id)))
    return r.capability_key


def test_batch_grants_are_exact_and_per_segment(tmp_path: Path) -> None:
    with MasterProcess(data_dir=str(tmp_path / "d")) as m, m.client() as c:
        k1, k2 = _mount(c, "s1"), _mount(c, "s2")
        assert k1 != k2
        r = c.call(BatchPutStart("c1", [f"k{i}" for i in range(4)], [100 + i for i in range(4)],
                                 PutOptions(replica_num=2)))
        keys = {"s1": k1, "s2": k2}
        assert len(r.caps) == 2  # one token per segment for the whole batch
        for i, (code, reps) in enumerate(zip(r.codes, r.replicas, strict=True)):
            assert code == 0 and len(reps) == 2
            for rep in reps:
                sid, off, length, cap = rep.segment_id, rep.offset, rep.length, r.caps[rep.cap]
                assert length == 100 + i
                verify(cap, keys[sid], sid, off, length, CapOp.WRITE)
                with pytest.raises(CapabilityError) as ei:  # one byte wider
                    verify(cap, keys[sid], sid, off, length + 1, CapOp.WRITE)
                assert ei.value.reason == DenyReason.OUT_OF_RANGE
                other = "s2" if sid == "s1" else "s1"
                with pytest.raises(CapabilityError):  # another segment's key
                    verify(cap, keys[other], sid, off, length, CapOp.WRITE)
        c.call(BatchPutEnd(client_id="c1", keys=[f"k{i}" for i in range(4)]))
        g = c.call(BatchGetReplicaList(keys=["k0", "k3", "nope"]))
        assert g.codes[2] == ErrorCode.OBJECT_NOT_FOUND
        for code, reps in zip(g.codes[:2], g.replicas[:2], strict=True):
            assert code == 0
            for rep in reps:
                sid, off, length = rep.segment_id, rep.offset, rep.length
                verify(g.caps[rep.cap], keys[sid], sid, off, length, CapOp.READ)
                # the token of one key's replica is refused for a range between keys
                with pytest.raises(CapabilityError) as ei:
                    verify(g.caps[rep.cap], keys[sid], sid, off + length, 1, CapOp.READ)
                assert ei.value.reason == DenyReason.OUT_OF_RANGE
        # tokens signed: one per segment per reply (2 + 2), not one per replica (8 + 4)
        assert c.call(Stats()).capabilities_granted == 4


def test_keys_survive_kill9_and_remount_rotates(tmp_path: Path) -> None:
    data = tmp_path / "d"
    with MasterProcess(data_dir=str(data)) as m:
        with m.client() as c:
            key = _mount(c, "s1")
            r = c.call(PutStart(client_id="c1", key="k", size=64))
            c.call(PutEnd(client_id="c1", key="k"))
        assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
        kf = data / "capability-keys.msgpack"
        assert stat.S_IMODE(os.stat(kf).st_mode) == 0o600
        m.kill()
        m.start()
        with m.client() as c:
            # the restored segment awaits its owner: re-adoption keeps the key, so a
            # grant made before the restart still verifies against the owner's key
            assert _mount(c, "s1") == key
            verify(r.caps[0], key, "s1", r.replicas[0].offset, 64, CapOp.WRITE)
            g = c.call(GetReplicaList(key="k"))
            verify(g.caps[0], key, "s1", g.replicas[0].offset, 64, CapOp.READ)
            # unmount + a fresh mount of the same id: a new key, old grants are dead
            c.call(UnmountSegment(client_id="c1", segment_id="s1"))
            new = _mount(c, "s1")
            assert new != key
            with pytest.raises(CapabilityError):
                verify(g.caps[0], new, "s1", g.replicas[0].offset, 64, CapOp.READ)


def test_capabilities_off_by_config(tmp_path: Path) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("capabilities: false\n")
    with MasterProcess(extra_args=["--config", str(cfg)]) as m, m.client() as c:
        r = c.call(MountSegment(client_id="c1", segment=segment_desc("s1", "c1")))
        assert r.capability_key == b""
        p = c.call(PutStart(client_id="c1", key="k", size=10))
        assert p.replicas[0].cap == -1 and p.caps == []


def test_too_many_requests_is_back_pressure_not_a_crash(tmp_path: Path) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("max_inflight_per_client: 8\n")
    with MasterProcess(extra_args=["--config", str(cfg)]) as m:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{m.address}")
        try:
            n = 3000
            for i in range(n):  # a pipelining flood on one connection
                s.send(encode_request(i, Exist("x")))
            codes: dict[int, int] = {}
            ids = set()
            for _ in range(n):
                assert s.poll(10000), "the master stopped answering"
                rep = decode_reply(s.recv())
                assert rep.id is not None
                ids.add(rep.id)
                codes[rep.code] = codes.get(rep.code, 0) + 1
            assert ids == set(range(n))  # every request answered, ids matched
            assert set(codes) <= {0, int(ErrorCode.TOO_MANY_REQUESTS)}
            assert codes.get(int(ErrorCode.TOO_MANY_REQUESTS), 0) > 0, codes
            assert codes.get(0, 0) > 0
        finally:
            s.close(0)
            ctx.term()
        with m.client() as c:  # still serving; the refusals are counted
            st = c.call(Stats())
            assert st.too_many_requests == codes[int(ErrorCode.TOO_MANY_REQUESTS)]

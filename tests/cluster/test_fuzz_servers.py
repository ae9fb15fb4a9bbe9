"""Fuzz the two servers a network peer can reach (docs/security.md): >= 10k malformed,
truncated, oversized, multi-frame and type-confused frames each to a real
``kvpool master`` and to a real node daemon's transfer server. Every frame
must get a typed error reply (or, for the few absurdly large ones, a dropped
connection), and afterwards both processes still answer valid requests and
the objects stored before the fuzzing read back byte-exact."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import OPS, GetSize, Op, decode_frame, decode_reply, encode_request
from kvpool.store import Client, ClientConfig

N_FRAMES = 10_500
SEED = 20261129
KNOWN_CODES = {int(c) for c in ErrorCode}


def _rand_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value of a random type (type confusion)."""
    kinds = ["int", "bigint", "neg", "float", "str", "bytes", "bool", "none"]
    if depth < 3:
        kinds += ["list", "map"]
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(0, 1 << 20)
    if k == "bigint":
        return rng.choice([(1 << 63) - 1, (1 << 64) - 1, 1 << 62, 1 << 40])
    if k == "neg":
        return -rng.randint(1, 1 << 62)
    if k == "float":
        return rng.choice([0.5, -1.0, float("inf"), float("nan"), 1e300])
    if k == "str":
        return "".join(rng.choice("ab\x00é/:*") for _ in range(rng.randint(0, 40)))
    if k == "bytes":
        return rng.randbytes(rng.randint(0, 80))
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k == "list":
        return [_rand_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {_rand_value(rng, 3) if rng.random() < 0.2 else rng.choice(
        ["key", "keys", "size", "client_id", "items", "segment", "force", "segment_ids",
         "replica_num", "preferred_segments", "checksum", "x"]): _rand_value(rng, depth + 1)
        for _ in range(rng.randint(0, 5))}


def _rand_args(rng: random.Random) -> dict[Any, Any]:
    """An args map: plausible names, values of random types."""
    names = ["key", "keys", "size", "client_id", "items", "segment", "force", "segment_ids",
             "replica_num", "preferred_segments", "checksum", "task_id", "ok", "x"]
    return {rng.choice(names): _rand_value(rng, 1) for _ in range(rng.randint(0, 6))}


def _common_garbage(rng: random.Random, valid: bytes) -> list[bytes] | None:
    """Protocol-independent bad frames, or None to let the caller build one."""
    r = rng.random()
    if r < 0.15:
        return [rng.randbytes(rng.randint(1, 300))]
    if r < 0.30:
        return [valid[: rng.randint(0, max(0, len(valid) - 1))] or b"\xc1"]  # truncated
    if r < 0.38:
        return [msgpack.packb(_rand_value(rng), use_bin_type=True)]  # not a map
    if r < 0.43:
        return [*[valid, rng.randbytes(rng.randint(0, 50))][: rng.randint(1, 2)], b"extra"]
    if r < 0.46:
        depth = rng.randint(100, 5000)  # deep nesting
        return [b"\x91" * depth + b"\xc0"]
    return None


def _master_code(frame: bytes) -> int:
    return decode_reply(frame).code  # a well-formed reply envelope


def _xfer_code(frame: bytes) -> int:
    rep = decode_frame(frame)
    assert isinstance(rep, dict), rep
    return int(rep.get("code"))  # type: ignore[arg-type]


def _blast(endpoint: str, make: Callable[[random.Random, int], list[bytes]], n: int,
           code_of: Callable[[bytes], int], window: int = 32) -> dict[int, int]:
    """Send ``n`` fuzz messages keeping ``window`` in flight; every one must
    get a reply with a known error code. Returns code -> count."""
    rng = random.Random(SEED)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    codes: dict[int, int] = {}
    sent = got = 0
    try:
        while got < n:
            while sent < n and sent - got < window:
                s.send_multipart(make(rng, sent))
                sent += 1
            assert s.poll(10_000), f"no reply after {got} of {n} fuzz frames"
            frames = s.recv_multipart()
            code = code_of(frames[0])
            assert code in KNOWN_CODES, code
            codes[code] = codes.get(code, 0) + 1
            got += 1
    finally:
        s.close(0)
        ctx.term()
    return codes


def _huge(endpoint: str, size: int) -> None:
    """Far beyond the frame limit: ZeroMQ drops the connection (MAXMSGSIZE)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(b"\x00" * size)
        s.poll(300)
    finally:
        s.close(0)
        ctx.term()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[MasterProcess, NodeDaemonProcess, dict[str, bytes]]]:
    mcfg = tmp_path / "master.yaml"
    mcfg.write_text("max_frame_size: 1048576\n")
    ccfg = tmp_path / "client.yaml"
    ccfg.write_text("transfer_overrides:\n  server:\n    max_request_bytes: 1MiB\n")
    with MasterProcess(extra_args=["--config", str(mcfg)]) as m, \
            NodeDaemonProcess(m.address, "8MiB", host_id="node0",
                              extra_args=["--config", str(ccfg)],
                              log_dir=str(tmp_path / "d")) as d:
        rng = random.Random(1)
        data = {f"intact-{i}": rng.randbytes(rng.randint(1, 200_000)) for i in range(8)}
        with Client(ClientConfig(master_address=m.address, host_id="tester")) as c:
            for k, v in data.items():
                c.put(k, v)
        yield m, d, data


def _check_intact(m: MasterProcess, data: dict[str, bytes]) -> None:
    with Client(ClientConfig(master_address=m.address, host_id="tester2",
                             checksum="crc32")) as c:  # tcp to the daemon
        for k, v in data.items():
            assert c.get(k) == v, k


def test_fuzz_master_and_transfer_server(
        pool: tuple[MasterProcess, NodeDaemonProcess, dict[str, bytes]]) -> None:
    m, d, data = pool
    ops = [int(o) for o in Op if o != Op.REMOVE_ALL]  # keep the stored objects reachable

    def master_frame(rng: random.Random, i: int) -> list[bytes]:
        from kvpool.core.protocol import Exist

        valid = encode_request(i, Exist("intact-0"))
        g = _common_garbage(rng, valid)
        if g is not None:
            return g
        r = rng.random()
        if r < 0.02:
            return [b"\x00" * (1_048_576 + rng.randint(1, 4096))]  # FRAME_TOO_LARGE
        op = rng.choice(ops) if r < 0.85 else _rand_value(rng)
        rid = i if rng.random() < 0.9 else _rand_value(rng)
        named = _rand_args(rng)
        spec = OPS.get(op) if type(op) is int else None  # type: ignore[call-overload]
        if rng.random() < 0.3:
            args: Any = _rand_value(rng)
        elif spec is not None:  # the op's fields in wire order, values of random types
            if rng.random() < 0.5:
                named["client_id"] = rng.choice(["c", "", 5, None])
            args = [named.get(f, _rand_value(rng, 1)) for f in spec.request.__struct_fields__]
            if rng.random() < 0.1:  # too few fields
                del args[rng.randint(0, len(args)):]
        else:
            args = list(named.values())
        if rng.random() < 0.05:  # the old map form
            return [msgpack.packb({"op": op, "id": rid, "args": named}, use_bin_type=True)]
        return [msgpack.packb([op, rid, args], use_bin_type=True)]

    seg = d.segment_ids[0]

    def xfer_frame(rng: random.Random, i: int) -> list[bytes]:
        valid = msgpack.packb({"op": 1, "id": i, "seg": seg, "off": 0, "len": 64, "cap": b""})
        g = _common_garbage(rng, valid)
        if g is not None:
            return g
        r = rng.random()
        if r < 0.02:
            return [b"\x80" + b"\x00" * 5000]  # header over max_header_bytes
        hdr: dict[str, Any] = {
            "op": rng.choice([1, 2, 3, 4, 0, 99, -1, True, "READ", None]),
            "id": i,
            "seg": rng.choice([seg, seg, "nope", "", 7, None, seg + "x"]),
            "off": rng.choice([0, 64, -1, 8 << 20, (1 << 64) - 1, 1.5, "0", None, True]),
            "len": rng.choice([0, 1, 64, 4096, -5, 2 << 20, 1 << 62, "x", None]),
            "cap": rng.choice([b"", rng.randbytes(70), "cap", 5, None,
                               b"\x02\x02" + rng.randbytes(60)]),
        }
        for k in list(hdr):
            if rng.random() < 0.05:
                del hdr[k]
        frames = [msgpack.packb(hdr, use_bin_type=True)]
        if hdr.get("op") == 2 or rng.random() < 0.1:  # WRITE payloads, right size or not
            ln = hdr.get("len")
            n = ln if isinstance(ln, int) else 10
            frames.append(b"\xee" * max(0, min(n if rng.random() < 0.7 else n + 3, 1 << 16)))
        return frames

    mcodes = _blast(f"tcp://{m.address}", master_frame, N_FRAMES, _master_code)
    xcodes = _blast(d.info["endpoint"], xfer_frame, N_FRAMES, _xfer_code)
    _huge(f"tcp://{m.address}", 3 << 20)
    _huge(d.info["endpoint"], 3 << 20)
    # the fuzzing exercised the typed refusals, not just one of them
    for c in (ErrorCode.MALFORMED_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.UNKNOWN_OP,
              ErrorCode.INVALID_PARAMS, ErrorCode.INVALID_KEY):
        assert mcodes.get(int(c), 0) > 0, (c, mcodes)
    assert mcodes.get(int(ErrorCode.INTERNAL_ERROR), 0) == 0, mcodes  # no handler crashed
    for c in (ErrorCode.MALFORMED_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.UNKNOWN_OP,
              ErrorCode.PERMISSION_DENIED, ErrorCode.OUT_OF_BOUNDS,
              ErrorCode.SEGMENT_NOT_FOUND):
        assert xcodes.get(int(c), 0) > 0, (c, xcodes)
    assert sum(mcodes.values()) == N_FRAMES and sum(xcodes.values()) == N_FRAMES
    assert m.running and d.running
    with m.client() as mc:
        assert mc.call(GetSize(key="intact-3")).size == len(data["intact-3"])
    _check_intact(m, data)

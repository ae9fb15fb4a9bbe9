"""Unit tests of the store's config, errors and buffer helpers (no processes)."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store import ReplicateConfig, load_client_config
from kvpool.store._bufutil import (
    alloc_bytes,
    buffer_nbytes,
    checksum_of,
    host_view,
    resolve_checksum_algo,
    verify_checksum,
)
from kvpool.store.errors import (
    AlreadyExists,
    BufferTooSmall,
    ChecksumMismatch,
    LeaseExpired,
    MasterUnreachable,
    NoSpace,
    ObjectNotFound,
    StoreError,
    StoreTimeout,
    TransferFailed,
    error_for_code,
)


def test_sizes_and_overrides() -> None:
    cfg = load_client_config(None, {"memory_size": "4GiB", "disk_size": "1GB",
                                    "disk_dir": "/tmp/x", "host_id": "h1"})
    assert cfg.memory_size == 4 << 30 and cfg.disk_size == 10**9 and cfg.host_id == "h1"


@pytest.mark.parametrize("bad", [
    {"memory_size": "lots"}, {"no_such_key": 1}, {"checksum": "md5"},
    {"rpc_timeout_s": 0}, {"disk_size": "1GiB"}, {"transfer_port": 70000},
])
def test_bad_config_is_a_config_error(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as ei:
        load_client_config(None, bad)
    assert ei.value.code == ErrorCode.CONFIG_ERROR


def test_replicate_config_mooncake_spellings() -> None:
    rc = ReplicateConfig()
    assert (rc.replica_num, rc.with_hard_pin, rc.soft_pin) == (1, False, False)
    assert rc.disk_replica_num == 0
    rc.replica_num = 2
    rc.preferred_segment = "h:1"
    rc.preferred_segments = ["h:2", "h:1"]
    rc.with_soft_pin = True
    assert rc.soft_pin is True
    args = rc.to_args()
    assert args["preferred_segments"] == ["h:1", "h:2"]
    assert args["replica_num"] == 2 and args["soft_pin"] is True


@pytest.mark.parametrize(("code", "cls"), [
    (ErrorCode.OBJECT_NOT_FOUND, ObjectNotFound), (ErrorCode.BUFFER_OVERFLOW, BufferTooSmall),
    (ErrorCode.NO_AVAILABLE_HANDLE, NoSpace), (ErrorCode.OBJECT_ALREADY_EXISTS, AlreadyExists),
    (ErrorCode.TRANSFER_FAIL, TransferFailed), (ErrorCode.TIMEOUT, StoreTimeout),
    (ErrorCode.RPC_TIMEOUT, MasterUnreachable), (ErrorCode.RPC_FAIL, MasterUnreachable),
    (ErrorCode.LEASE_EXPIRED, LeaseExpired), (ErrorCode.CHECKSUM_MISMATCH, ChecksumMismatch),
    (ErrorCode.OBJECT_HAS_LEASE, StoreError),
])
def test_error_for_code(code: ErrorCode, cls: type[StoreError]) -> None:
    exc = error_for_code(code, "x")
    assert type(exc) is cls and exc.code == code
    assert isinstance(exc, KVPoolError)
    assert error_for_code(12345).code == ErrorCode.INTERNAL_ERROR


def test_buffer_helpers() -> None:
    arr = np.arange(100, dtype=np.float32)
    assert buffer_nbytes(arr) == 400
    assert buffer_nbytes(b"abc") == 3 and buffer_nbytes(bytearray(5)) == 5
    assert buffer_nbytes(memoryview(arr)) == 400
    assert buffer_nbytes((arr.ctypes.data, 400)) == 400
    v = host_view(arr)
    assert v is not None and v.nbytes == 400 and v.format == "B"
    raw = host_view((arr.ctypes.data, 400))
    assert raw is not None and bytes(raw) == arr.tobytes()


def test_alloc_bytes_is_writable_in_place() -> None:
    b, buf = alloc_bytes(4096)
    ctypes.memmove(buf.ptr, b"x" * buf.length, buf.length)
    assert b == b"x" * 4096
    assert buf.owner is b  # the buffer keeps the bytes alive while a transfer holds it
    buf.array[:2] = 7
    assert b[:3] == b"\x07\x07x"


def test_checksums() -> None:
    data = b"hello" * 1000
    c = checksum_of("crc32", data)
    assert c == f"crc32:{zlib.crc32(data):08x}"
    assert verify_checksum(c, data) is True
    assert verify_checksum(c, data[:-1] + b"x") is False
    assert verify_checksum("sha9:00", data) is None
    assert resolve_checksum_algo("none") is None
    assert resolve_checksum_algo("crc32") == "crc32"
    assert resolve_checksum_algo("auto") in ("crc32", "xxh64")

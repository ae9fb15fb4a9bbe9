"""FileSegment: on-disk format, create/reopen, refusals, direct I/O, bounds."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from tier_helpers import aligned_empty, pattern

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.transfer.file_segment import (
    DEFAULT_FILE_NAME,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    FileSegment,
    SegmentFileError,
    SegmentHeader,
    read_header,
)
from kvpool.transfer.types import TransferError

MiB = 1 << 20


def test_create_writes_header_and_preallocates(tmp_path):
    seg = FileSegment.open(str(tmp_path), 4 * MiB, "seg-a")
    try:
        assert seg.created and seg.generation == 1
        assert seg.base_offset == HEADER_SIZE and seg.base_offset % 4096 == 0
        st = os.stat(seg.path)
        assert st.st_size == HEADER_SIZE + 4 * MiB
        assert st.st_blocks * 512 >= 4 * MiB  # really allocated, not sparse
        assert st.st_mode & 0o777 == 0o600
        raw = open(seg.path, "rb").read(HEADER_SIZE)
        assert raw[:8] == MAGIC
        h = read_header(seg.path)
        assert (h.segment_id, h.size, h.base_offset, h.generation, h.version) == \
            ("seg-a", 4 * MiB, HEADER_SIZE, 1, FORMAT_VERSION)
        desc = seg.descriptor("c1", "h1", "tcp://127.0.0.1:1")
        assert desc.kind == SegmentKind.FILE and desc.name == seg.path
        assert desc.size == 4 * MiB and desc.base_offset == HEADER_SIZE
        assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    finally:
        seg.close()


def test_reopen_keeps_id_and_data_and_bumps_generation(tmp_path):
    data = pattern(1, 100_003)
    seg = FileSegment.open(str(tmp_path), 2 * MiB)
    sid = seg.segment_id
    seg.write_from(12_345, data)
    seg.close()
    again = FileSegment.open(str(tmp_path), 2 * MiB)
    try:
        assert not again.created
        assert again.segment_id == sid and again.generation == 2
        out = np.empty(data.size, np.uint8)
        again.read_into(12_345, out)
        assert zlib.crc32(out.data) == zlib.crc32(data.data)
    finally:
        again.close()
    assert read_header(again.path).generation == 2
    # reopening with the expected id is fine too
    FileSegment.open(str(tmp_path), 2 * MiB, sid).close()


@pytest.mark.parametrize("size", [1, 7, 4095, 4096, 4097, 65_537, MiB + 3, 16 * MiB + 1,
                                  64 * MiB])
def test_read_write_unaligned_sizes_with_checksums(tmp_path, size):
    seg = FileSegment.open(str(tmp_path), 64 * MiB + 8192)
    try:
        off = 4096 * 3 + 1 if size < 64 * MiB else 4093  # unaligned
        data = pattern(size, size)
        seg.write_from(off, memoryview(data.tobytes()))  # bytes-like source
        out = bytearray(size)
        seg.read_into(off, memoryview(out))
        assert zlib.crc32(out) == zlib.crc32(data.data)
    finally:
        seg.close()


def test_aligned_io_uses_o_direct(tmp_path):
    seg = FileSegment.open(str(tmp_path), 8 * MiB)
    try:
        assert seg.io.has_direct, seg.io.direct_reason
        src = aligned_empty(MiB)
        src[:] = pattern(5, MiB)
        seg.write_from(4096, src)
        assert seg.io.direct_ops == 1
        dst = aligned_empty(MiB)
        seg.read_into(4096, dst)
        assert seg.io.direct_ops == 2
        assert np.array_equal(src, dst)
        # same range, unaligned buffer: buffered path, same bytes
        before = seg.io.buffered_ops
        odd = np.empty(MiB + 1, np.uint8)[1:]
        seg.read_into(4096, odd)
        assert seg.io.buffered_ops == before + 1 and np.array_equal(odd, src)
    finally:
        seg.close()


def test_out_of_bounds_and_full_segment(tmp_path):
    seg = FileSegment.open(str(tmp_path), MiB)
    try:
        tail = pattern(9, 4096)
        seg.write_from(MiB - 4096, tail)  # exactly fills the end
        out = np.empty(4096, np.uint8)
        seg.read_into(MiB - 4096, out)
        assert np.array_equal(out, tail)
        for off, n in ((MiB - 10, 11), (MiB, 1), (-1, 4)):
            with pytest.raises(TransferError) as ei:
                seg.write_from(off, np.zeros(n, np.uint8))
            assert ei.value.code == ErrorCode.OUT_OF_BOUNDS
        with pytest.raises(TransferError) as ei:
            seg.read_into(MiB - 1, np.empty(2, np.uint8))
        assert ei.value.code == ErrorCode.OUT_OF_BOUNDS
    finally:
        seg.close()
    # the header region is never reachable through the usable offsets
    assert read_header(seg.path).segment_id == seg.segment_id


def test_mismatched_size_is_refused(tmp_path):
    FileSegment.open(str(tmp_path), 2 * MiB).close()
    with pytest.raises(SegmentFileError) as ei:
        FileSegment.open(str(tmp_path), 4 * MiB)
    assert ei.value.code == ErrorCode.SEGMENT_MISMATCH
    assert "another size" in str(ei.value)
    assert os.path.getsize(tmp_path / DEFAULT_FILE_NAME) == HEADER_SIZE + 2 * MiB  # untouched


def test_mismatched_id_is_refused(tmp_path):
    FileSegment.open(str(tmp_path), MiB, "seg-x").close()
    with pytest.raises(SegmentFileError) as ei:
        FileSegment.open(str(tmp_path), MiB, "seg-y")
    assert ei.value.code == ErrorCode.SEGMENT_MISMATCH and "seg-x" in str(ei.value)


def test_truncated_file_is_refused(tmp_path):
    seg = FileSegment.open(str(tmp_path), 2 * MiB)
    seg.close()
    os.truncate(seg.path, HEADER_SIZE + MiB)
    with pytest.raises(SegmentFileError) as ei:
        FileSegment.open(str(tmp_path), 2 * MiB)
    assert ei.value.code == ErrorCode.SEGMENT_MISMATCH and "truncated" in str(ei.value)
    os.truncate(seg.path, 100)  # not even a whole header
    with pytest.raises(SegmentFileError):
        FileSegment.open(str(tmp_path), 2 * MiB)


def test_foreign_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / DEFAULT_FILE_NAME
    junk = os.urandom(HEADER_SIZE + MiB)
    path.write_bytes(junk)
    with pytest.raises(SegmentFileError) as ei:
        FileSegment.open(str(tmp_path), MiB)
    assert ei.value.code == ErrorCode.SEGMENT_MISMATCH and "not a kvpool segment" in str(ei.value)
    assert path.read_bytes() == junk


def test_corrupt_header_is_refused(tmp_path):
    seg = FileSegment.open(str(tmp_path), MiB)
    seg.close()
    with open(seg.path, "r+b") as f:
        f.seek(30)
        b = f.read(1)
        f.seek(30)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(SegmentFileError) as ei:
        FileSegment.open(str(tmp_path), MiB)
    assert "checksum" in str(ei.value)


def test_other_format_version_is_refused(tmp_path):
    seg = FileSegment.open(str(tmp_path), MiB)
    seg.close()
    h = read_header(seg.path)
    raw = bytearray(SegmentHeader(h.segment_id, h.size, h.base_offset, h.generation,
                                  h.created_ns, version=FORMAT_VERSION + 1).encode())
    with open(seg.path, "r+b") as f:
        f.write(raw)
    with pytest.raises(SegmentFileError) as ei:
        FileSegment.open(str(tmp_path), MiB)
    assert ei.value.code == ErrorCode.INVALID_VERSION


def test_second_owner_is_refused_while_first_holds_it(tmp_path):
    seg = FileSegment.open(str(tmp_path), MiB)
    try:
        # another process trying to mount the same file
        code = subprocess.run(
            [sys.executable, "-c",
             "import sys\n"
             "from kvpool.transfer.file_segment import FileSegment, SegmentFileError\n"
             "try:\n"
             f"    FileSegment.open({str(tmp_path)!r}, {MiB})\n"
             "except SegmentFileError as e:\n"
             "    sys.exit(-int(e.code))\n"
             "sys.exit(0)\n"],
            timeout=30).returncode
        assert code == -int(ErrorCode.SEGMENT_ALREADY_EXISTS) & 0xFF
    finally:
        seg.close()
    FileSegment.open(str(tmp_path), MiB).close()  # free again once closed


def test_no_space_for_preallocation_is_a_typed_error(tmp_path):
    huge = 1 << 60  # more than any disk here
    with pytest.raises(TransferError) as ei:
        FileSegment.open(str(tmp_path), huge)
    assert ei.value.code == ErrorCode.NO_AVAILABLE_HANDLE
    assert os.listdir(tmp_path) == []  # nothing half-created left behind


def test_create_false_and_bad_args(tmp_path):
    with pytest.raises(SegmentFileError) as ei:
        FileSegment.open(str(tmp_path), MiB, create=False)
    assert ei.value.code == ErrorCode.SEGMENT_NOT_FOUND
    for bad in (0, -1):
        with pytest.raises(TransferError) as ei2:
            FileSegment.open(str(tmp_path), bad)
        assert ei2.value.code == ErrorCode.INVALID_PARAMS
    with pytest.raises(TransferError):
        FileSegment.open(str(tmp_path), MiB, file_name="../x")


def test_closed_segment_refuses_io_and_destroy_deletes(tmp_path):
    seg = FileSegment.open(str(tmp_path), MiB)
    seg.close()
    seg.close()  # idempotent
    with pytest.raises(TransferError) as ei:
        seg.read_into(0, np.empty(1, np.uint8))
    assert ei.value.code == ErrorCode.CLOSED
    assert os.path.exists(seg.path)
    seg.destroy()
    assert not os.path.exists(seg.path)


def test_header_struct_is_stable():
    # the on-disk layout is a format: guard it against accidental edits
    h = SegmentHeader("abc", 123, 4096, 7, 99)
    raw = h.encode()
    assert len(raw) == HEADER_SIZE
    assert raw[:8] == MAGIC and struct.unpack_from("<II", raw, 8) == (FORMAT_VERSION, HEADER_SIZE)
    assert SegmentHeader.decode(raw) == h


def test_create_reopens_existing_file_and_keeps_its_id(tmp_path):
    """``create`` is what a node calls at start: a restart with another
    proposed id (e.g. a new port) must still re-mount the same segment."""
    first = FileSegment.create("host:1111:disk", str(tmp_path), MiB)
    assert first.created and first.segment_id == "host:1111:disk"
    first.write_from(0, b"warm")
    first.close()
    again = FileSegment.create("host:2222:disk", str(tmp_path), MiB)
    try:
        assert not again.created and again.segment_id == "host:1111:disk"
        out = bytearray(4)
        again.read_into(0, memoryview(out))
        assert bytes(out) == b"warm"
    finally:
        again.close()


def test_create_with_another_size_starts_the_tier_afresh(tmp_path):
    """The configured size changed (e.g. derived from the free disk): the
    node still starts; the tier is new (another id, no old byte), smaller
    or larger; a file another process owns is never discarded."""
    first = FileSegment.create("host:1:disk", str(tmp_path), MiB)
    first.write_from(0, b"warm")
    first.close()
    ids = {first.segment_id}
    for size in (2 * MiB, MiB // 2):
        seg = FileSegment.create("host:1:disk", str(tmp_path), size)
        try:
            assert seg.created and seg.size == size and seg.segment_id not in ids
            ids.add(seg.segment_id)
            out = bytearray(4)
            seg.read_into(0, memoryview(out))
            assert bytes(out) == bytes(4)  # nothing of the old tier
            assert os.path.getsize(seg.path) == HEADER_SIZE + size
        finally:
            seg.close()
    owned = FileSegment.create("host:1:disk", str(tmp_path), MiB // 2)  # same size: reopened
    try:
        assert not owned.created and owned.segment_id in ids
        with pytest.raises(SegmentFileError) as ei:
            FileSegment.create("host:1:disk", str(tmp_path), MiB)
        assert ei.value.code == ErrorCode.SEGMENT_ALREADY_EXISTS
        assert os.path.getsize(owned.path) == HEADER_SIZE + MiB // 2  # untouched
    finally:
        owned.close()

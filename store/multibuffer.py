"""Multi-buffer values: an object stored from, or read into, several buffers.

Mooncake's multi-buffer calls (vLLM and SGLang use them: one buffer per layer,
or per K and V of a block) store a key's value as the concatenation of its
parts and read it back scattered over the parts, in order. They are built on
the write path (grant, write ranges, end) and the read loop (locate, read
ranges), each call at most one master call per step and one transfer batch:

- several host parts of a small object (under ``GATHER_MAX``) are gathered
  into one staging array and moved as one range (a memcpy costs far less than
  a request each), and read back into one and scattered;
- several GPU parts of one device go through one device staging buffer (a
  few 2-D device copies for the whole call, :mod:`kvpool.store._gpustage`);
- anything else moves part by part, one range each.

A checksum of a multi-buffer value is the checksum of the concatenation
(:func:`parts_checksum`), verified after a read that covers every part.
"""

from __future__ import annotations

import functools
import logging
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.store._bufutil import buffer_nbytes, host_array, host_view, resolve_checksum_algo
from kvpool.store._gpustage import (
    STAGING_MAX_BYTES,
    DeviceStaging,
    gpu_regions,
    plan_copies,
    run_copies,
)
from kvpool.store.config import ReplicateConfig
from kvpool.store.errors import StoreError
from kvpool.store.located import Location
from kvpool.store.reads import Reads
from kvpool.store.writes import Reservation, Writes, config_for
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.gpu import cuda_runtime

__all__ = ["GATHER_MAX", "MultiBuffer", "parts_checksum", "parts_checksum_ok"]

log = logging.getLogger(__name__)

GATHER_MAX = 4 << 20  # objects below this gather/scatter their host parts in one pass
_OK = ErrorCode.OK

# per key, the GPU regions of its parts: (key index, [(address, bytes)])
_GpuKeys = list[tuple[int, list[tuple[int, int]]]]
# a key's range of the device staging buffer, and the GPU regions of its parts
_Staged = tuple[BufferHandle, list[tuple[int, int]]]


class MultiBuffer:
    """Multi-buffer puts and gets of one client (module docstring)."""

    def __init__(self, writes: Writes, reads: Reads) -> None:
        self.writes = writes
        self.reads = reads
        self._staging: DeviceStaging | None = None
        self._staging_lock = threading.Lock()

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()

    # ------------------------------------------------------------------ puts

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
            config: ReplicateConfig | None = None, upsert: bool = False) -> list[ErrorCode]:
        """Store each key's value as the concatenation of its parts; per key
        the put codes (see Client.batch_put_parts)."""
        writes = self.writes
        writes.session.check()
        if len(keys) != len(parts):
            raise StoreError(f"{len(keys)} keys but {len(parts)} part lists",
                             ErrorCode.INVALID_PARAMS)
        sizes = [sum(buffer_nbytes(p) for p in ps) for ps in parts]
        checksums = None
        if writes.checksum_algo is not None:
            checksums = [parts_checksum(writes.checksum_algo, ps) for ps in parts]
        held = writes.grant(keys, sizes, config, checksums, upsert)
        term = writes.session.term
        codes = [g.code for g in held]
        granted = [i for i, c in enumerate(codes) if c == _OK]
        give_back: Callable[[], None] | None = None
        try:
            bufs, offs, lens, reps, caps, owner, give_back = self._plan_writes(held, parts)
            wrote = writes._write(range(len(owner)), bufs, lens, reps, caps, offs, None)
        except BaseException:
            writes.session.revoke([keys[i] for i in granted])
            raise
        finally:
            if give_back is not None:
                give_back()
        for c, i in zip(wrote, owner, strict=True):
            if c:
                codes[i] = ErrorCode.TRANSFER_FAIL
        writes.session.revoke([keys[i] for i in granted if codes[i] != _OK])
        good = [i for i in granted if codes[i] == _OK]
        if good:
            ends = writes.end([keys[i] for i in good], term, upsert,
                              lambda lost: self.put([keys[good[p]] for p in lost],
                                                    [parts[good[p]] for p in lost],
                                                    config_for(config, [good[p] for p in lost]),
                                                    upsert))
            for i, c in zip(good, ends, strict=True):
                codes[i] = c
        return codes

    def _plan_writes(self, held: Sequence[Reservation], parts: Sequence[Sequence[Any]]
                     ) -> tuple[list[Any], list[int], list[int], list[Any], list[list[bytes]],
                                list[int], Callable[[], None] | None]:
        """The ranges to write for the granted keys, as columns (buffer,
        offset in the object, bytes, replicas, tokens, key index), and what
        gives the device staging buffer back (None: nothing staged)."""
        bufs: list[Any] = []
        offs: list[int] = []
        lens: list[int] = []
        reps: list[Any] = []
        caps: list[list[bytes]] = []
        owner: list[int] = []

        def add(i: int, buf: Any, off: int, n: int) -> None:
            g = held[i]
            bufs.append(buf)
            offs.append(off)
            lens.append(n)
            reps.append(g.replicas)
            caps.append(g.caps)
            owner.append(i)

        ok = [i for i, g in enumerate(held) if g.code == _OK]
        staged, give_back = self._stage_gpu([held[i].size for i in range(len(held))], parts, ok,
                                            gather=True)
        for i, (handle, _regions) in staged.items():
            add(i, handle, 0, held[i].size)
        for i in ok:
            if i in staged:
                continue
            size, ps = held[i].size, parts[i]
            arrs = _host_arrays(ps) if 0 < size < GATHER_MAX and len(ps) > 1 else None
            if arrs is not None:
                add(i, np.concatenate(arrs), 0, size)  # type: ignore[arg-type]
                continue
            off = 0
            for p in ps:
                n = buffer_nbytes(p)
                if n:
                    add(i, p, off, n)
                off += n
        return bufs, offs, lens, reps, caps, owner, give_back

    # ------------------------------------------------------------------ gets

    def get(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        """Read each key's value scattered over its parts in order; per key the
        object size or a negative code (see Client.batch_get_parts)."""
        if len(keys) != len(parts):
            raise StoreError(f"{len(keys)} keys but {len(parts)} part lists",
                             ErrorCode.INVALID_PARAMS)
        locs = self.reads.locate(keys) if keys else []
        results = [int(loc.code) for loc in locs]
        rlocs: list[Location] = []
        bufs: list[Any] = []
        offs: list[int] = []
        lens: list[int] = []
        owner: list[int] = []
        scatter: list[tuple[int, np.ndarray, list[np.ndarray]]] = []
        maybe_gpu: list[int] = []

        def add(i: int, buf: Any, off: int, n: int) -> None:
            rlocs.append(locs[i])
            bufs.append(buf)
            offs.append(off)
            lens.append(n)
            owner.append(i)

        def part_by_part(i: int) -> None:
            loc, off = locs[i], 0
            for p in parts[i]:
                n = min(buffer_nbytes(p), loc.size - off)
                if n <= 0:
                    break
                add(i, p, off, n)
                off += n

        for i, (loc, ps) in enumerate(zip(locs, parts, strict=True)):
            if loc.code != _OK:
                continue
            if sum(buffer_nbytes(p) for p in ps) < loc.size:
                results[i] = int(ErrorCode.BUFFER_OVERFLOW)
                continue
            results[i] = loc.size
            if 0 < loc.size < GATHER_MAX and len(ps) > 1:
                arrs = _host_arrays(ps, writeable=True)
                if arrs is not None:  # one range into a staging array, scattered after
                    tmp = np.empty(loc.size, dtype=np.uint8)
                    scatter.append((i, tmp, arrs))
                    add(i, tmp, 0, loc.size)
                    continue
            if len(ps) > 1 and loc.size > 0:
                maybe_gpu.append(i)
                continue
            part_by_part(i)
        staged, give_back = self._stage_gpu([loc.size for loc in locs], parts, maybe_gpu,
                                            gather=False)
        for i in maybe_gpu:
            if i in staged:
                add(i, staged[i][0], 0, locs[i].size)
            else:
                part_by_part(i)
        try:
            for code, i in zip(self.reads.read(rlocs, bufs, offs, lens), owner, strict=True):
                if code < 0 and results[i] >= 0:
                    results[i] = code
            if staged:
                self._scatter_gpu(staged, parts, locs, results)
        finally:
            if give_back is not None:
                give_back()
        for i, tmp, arrs in scatter:
            if results[i] >= 0:
                _scatter(tmp, arrs)
        if self.reads.config.verify_checksum:
            for i, loc in enumerate(locs):
                if results[i] >= 0 and isinstance(loc.checksum, str) and \
                        parts_checksum_ok(loc.checksum, parts[i], loc.size) is False:
                    results[i] = int(ErrorCode.CHECKSUM_MISMATCH)
        return results

    # ------------------------------------------------------------------ GPU staging

    def _stage_gpu(self, sizes: Sequence[int], parts: Sequence[Sequence[Any]],
                   want: Sequence[int], gather: bool
                   ) -> tuple[dict[int, _Staged], Callable[[], None] | None]:
        """Keys of ``want`` made of several GPU parts of one device that fit
        one staging buffer together: each gets a range of one device staging
        buffer (``gather``: their parts copied in already, a few 2-D copies
        for all). Returns key index -> its staged range as a GPU buffer, and
        what gives the staging buffer back (None: nothing staged)."""
        device, total, keys = _gpu_keys(sizes, parts, want)
        taken = self._device_staging(device, total) if keys else None
        if taken is None:
            return {}, None
        staging, buf = taken
        at = buf[0]
        out: dict[int, _Staged] = {}
        per_key: list[list[tuple[int, int, int]]] = []
        for i, regions in keys:
            copies, off = [], at
            for ptr, n in regions:
                copies.append((off, ptr, n))
                off += n
            per_key.append(copies)
            out[i] = (BufferHandle(ptr=at, length=sizes[i], device="cuda", device_index=device),
                      regions)
            at += sizes[i]
        if gather:
            try:
                run_copies(staging.rt, plan_copies(per_key), device)
            except Exception as exc:  # write part by part instead
                log.warning("GPU gather of %d keys failed: %s", len(keys), exc)
                staging.give(device, buf)
                return {}, None
        return out, functools.partial(staging.give, device, buf)

    @staticmethod
    def _scatter_gpu(staged: dict[int, _Staged], parts: Sequence[Sequence[Any]],
                     locs: Sequence[Location], results: list[int]) -> None:
        """Scatter the keys read into device staging over their GPU parts;
        keys whose read failed are skipped."""
        per_key: list[list[tuple[int, int, int]]] = []
        done: list[int] = []
        device = 0
        rt = None
        for i, (h, regions) in staged.items():
            if results[i] < 0:
                continue
            device = h.device_index
            src, left = h.ptr, locs[i].size
            copies = []
            for ptr, n in regions:
                n = min(n, left)
                if n <= 0:
                    break
                copies.append((ptr, src, n))
                src += n
                left -= n
            per_key.append(copies)
            done.append(i)
        if not done:
            return
        rt = cuda_runtime()[0]
        try:
            assert rt is not None
            run_copies(rt, plan_copies(per_key), device)
        except Exception as exc:
            log.warning("GPU scatter of %d keys failed: %s", len(done), exc)
            for i in done:
                results[i] = int(ErrorCode.TRANSFER_FAIL)

    def _device_staging(self, device: int, nbytes: int
                        ) -> tuple[DeviceStaging, tuple[int, int]] | None:
        """A device staging buffer of ``nbytes`` (kvpool.store._gpustage), or None."""
        with self._staging_lock:
            staging = self._staging
            if staging is None:
                rt, _ = cuda_runtime()
                if rt is None:
                    return None
                staging = self._staging = DeviceStaging(rt)
        buf = staging.take(device, nbytes)
        return None if buf is None else (staging, buf)


def _gpu_keys(sizes: Sequence[int], parts: Sequence[Sequence[Any]], want: Sequence[int]
              ) -> tuple[int, int, _GpuKeys]:
    """Of the keys ``want``, those made of several GPU parts of one device that
    fit one staging buffer together: ``(device, total bytes, [(key, [(address,
    bytes)])])``."""
    device, total = -1, 0
    out: _GpuKeys = []
    for i in want:
        if len(parts[i]) < 2 or total + sizes[i] > STAGING_MAX_BYTES:
            continue
        found = gpu_regions(parts[i])
        if found is None or (device >= 0 and found[0] != device):
            continue
        device = found[0]
        out.append((i, found[1]))
        total += sizes[i]
    return device, total, out


def _scatter(src: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """Copy ``src`` over the flat uint8 arrays ``parts`` in order (the last one
    may be filled partly)."""
    off, size = 0, src.size
    for a in parts:
        end = off + a.size
        if end >= size:
            np.copyto(a[:size - off], src[off:size])
            return
        np.copyto(a, src[off:end])
        off = end


def _host_arrays(parts: Sequence[Any], writeable: bool = False) -> list[np.ndarray] | None:
    """Flat uint8 host arrays of every part, or None as soon as one is not
    host memory (or not writeable, with ``writeable``)."""
    out = []
    for p in parts:
        if type(p) is np.ndarray and p.dtype == np.uint8 and p.ndim == 1 \
                and p.flags.c_contiguous:
            a: np.ndarray | None = p
        else:
            a = host_array(p)
        if a is None or (writeable and not a.flags.writeable):
            return None
        out.append(a)
    return out


def parts_checksum(algo: str, parts: Sequence[Any]) -> str | None:
    """The checksum of the concatenation of ``parts`` without joining them;
    None when a part is not host memory (GPU buffers are not hashed)."""
    views = [host_view(p) for p in parts]
    if any(v is None for v in views):
        return None
    if algo == "xxh64":
        import xxhash  # type: ignore[import-not-found]  # resolve_checksum_algo checked it

        h = xxhash.xxh64()
        for v in views:
            h.update(v)
        return "xxh64:" + str(h.hexdigest())
    crc = 0
    for v in views:
        assert v is not None
        crc = zlib.crc32(v, crc)
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def parts_checksum_ok(expected: str, parts: Sequence[Any], size: int) -> bool | None:
    """Whether the first ``size`` bytes of ``parts`` match ``expected``; None
    when that cannot be checked here (GPU part, unknown algorithm)."""
    algo = expected.partition(":")[0]
    if algo not in ("crc32", "xxh64") or resolve_checksum_algo(
            "xxhash" if algo == "xxh64" else "crc32") != algo:
        return None
    trimmed: list[Any] = []
    left = size
    for p in parts:
        if left <= 0:
            break
        v = host_view(p)
        if v is None:
            return None
        trimmed.append(v[:left])
        left -= len(trimmed[-1])
    got = parts_checksum(algo, trimmed)
    return None if got is None else got == expected

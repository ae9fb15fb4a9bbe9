"""Helpers of the Directory unit tests: a directory on a controllable clock,
segments mounted without a real region, puts done start to end."""

from __future__ import annotations

from typing import Any

from kvpool.core.protocol import RESERVED_KEY_PREFIX, SegmentDescriptor, SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory, SegState
from support.clock import Clock

__all__ = ["FILE", "MEM", "make", "mount", "put", "reserve", "restored_state", "seg_ids"]

MEM = SegmentKind.MEMORY
FILE = SegmentKind.FILE


def make(shard_bits: int = 8, **cfg: Any) -> tuple[Directory, Clock]:
    """A Directory of ``MasterConfig(**cfg)`` and the clock it reads."""
    clock = Clock()
    return Directory(MasterConfig(**cfg), clock=clock, shard_bits=shard_bits), clock


def mount(d: Directory, sid: str, size: int, kind: SegmentKind = MEM, client: str = "c1") -> None:
    d.mount(client, SegmentDescriptor(sid, client, "h", kind, size, f"kvpool-{sid}"))


def put(d: Directory, key: str, size: int, client: str = "c1", **kw: Any) -> int:
    """put_start then put_end of ``key``; the first code that is not OK, or OK."""
    code, _ = d.put_start(client, key, size, **kw)
    if code:
        return int(code)
    return int(d.put_end(client, key))


def reserve(d: Directory, client: str, placeholder: str, size: int,
            group: str | None = None) -> tuple[int, Any]:
    """A reservation as the handlers make one: a put of the placeholder key
    (reserved: below KEY_MIN); (code, its put in flight)."""
    codes = [0]
    d.writes.put_start_many(client, [placeholder], [size], codes, [None],
                            groups=None if group is None else [group],
                            key_min=RESERVED_KEY_PREFIX)
    return codes[0], d.pending.get(placeholder)


def seg_ids(d: Directory, key: str) -> list[str]:
    """The segments holding ``key``'s replicas."""
    return [s.id for s in d.objects[key].replicas[::2]]


def restored_state(d: Directory) -> dict[str, Any]:
    """What a restore must bring back, comparable with ``==``: each object's
    size, flags, checksum and live replicas; each segment's allocator
    (checked consistent) and key set; each tenant's usage."""
    objs = {}
    for k, o in d.objects.items():
        reps = sorted((o.replicas[i].id, o.replicas[i + 1]) for i in range(0, len(o.replicas), 2)
                      if o.replicas[i].state != SegState.DEAD)
        objs[k] = (o.size, o.flags, o.checksum, reps)
    for seg in d.segments.values():
        seg.alloc.check()
    segs = {s.id: (s.alloc.used, s.alloc.free, sorted(s.keys)) for s in d.segments.values()}
    tenants = sorted((t.name, t.mem, t.disk, t.objects) for t in d.tenants.by_name.values())
    return {"objects": objs, "segments": segs, "tenants": tenants}

"""The master's wire protocol: one typed schema per op, used by both ends.

Every op has a request and a reply type (msgspec Structs, encoded as
msgpack arrays in field order); :data:`OPS` maps each :class:`Op` to them and
is the op table (``docs/INTERFACES.md`` is generated from it by
:func:`op_table_markdown`). The server decodes a request straight into its
Struct, so the schema *is* the argument check: a wrong type, a missing field
or a wrong count is an ``INVALID_PARAMS`` reply (``INVALID_KEY`` when the
bad field is a key), never a crash. Checks that depend on the master's
configuration (key length, sizes, batch length) stay in the handlers.

This module is the one name every layer imports the protocol by; it holds the
op table's documentation and re-exports three rooms:

- :mod:`kvpool.core.codec`: op codes, the Request/Reply bases, the op
  registry, framing and the frame codec (the hot path of every call);
- :mod:`kvpool.core.ops`: one request and one reply Struct per op;
- :mod:`kvpool.core.descriptors`: the values ops carry (segment and replica
  descriptors, placement options, tier tasks) and the rules for keys.

Framing (the same bytes over ZeroMQ and over the same-host Unix socket of
:mod:`kvpool.master.local_rpc`, where each frame is prefixed with its length
as ``LOCAL_FRAME_HEADER`` bytes little-endian)::

    request  [op: int, id: int, args: <the op's request Struct>]
    reply    [id: int | nil, code: int(ErrorCode), result: <reply Struct> | nil, error: str]

``result`` is nil unless ``code`` is OK. A frame that is not such an array
gets a ``MALFORMED_FRAME`` reply with id nil, an unknown op ``UNKNOWN_OP``,
a frame above ``max_frame_size`` ``FRAME_TOO_LARGE``.

Batch ops take columns (``keys``, ``sizes``) and answer per-key ``codes`` in
input order beside per-key value columns. Replicas of put and get replies
carry an index into the reply's ``caps`` list: one capability token signed
per segment and batch (:mod:`kvpool.core.capability`), not one per key.

Adding an op: define ``XRequest(Request[XReply])`` and ``XReply(Reply)`` in
:mod:`kvpool.core.ops`, decorate the request with
``@register(Op.X, XReply, "summary")`` (and give :class:`Op` its code), add
the handler ``x`` (named after the op) to the group of ``kvpool.master`` whose
concern it is (``WriteOps``, ``ReadOps``, ``SegmentOps``, ``AdminOps``),
then run ``python -m kvpool.core.protocol`` to refresh the table in
``docs/INTERFACES.md`` (a test checks they match).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvpool.core import codec, descriptors, ops
from kvpool.core.codec import *  # noqa: F403  (re-exported: see the module doc)
from kvpool.core.codec import OPS
from kvpool.core.descriptors import *  # noqa: F403
from kvpool.core.descriptors import (
    PutOptions,
    ReplicaDescriptor,
    SegmentDescriptor,
    SegmentInfo,
    TierTask,
)
from kvpool.core.ops import *  # noqa: F403

__all__ = sorted([*codec.__all__, *ops.__all__, *descriptors.__all__, "op_table_markdown"])


# ------------------------------------------------------------------ docs

#: the modules whose names the table leaves out of type names (they define the
#: protocol's own types; kvpool.core.events' keep their module)
_OWN_MODULES = re.compile(r"kvpool\.core\.(?:protocol|codec|ops|descriptors)\.")


def _type_name(t: Any) -> str:
    name = getattr(t, "__name__", None)
    if name is not None and not getattr(t, "__args__", None):
        return str(name)
    return _OWN_MODULES.sub("", str(t).replace("typing.", ""))


def _fields(cls: type[msgspec.Struct]) -> str:
    parts = []
    for f in msgspec.structs.fields(cls):
        s = f"{f.name}: {_type_name(f.type)}"
        if f.default is not msgspec.NODEFAULT:
            s += f" = {f.default!r}"
        elif f.default_factory is not msgspec.NODEFAULT:
            s += f" = {f.default_factory()!r}"
        parts.append(s)
    return ", ".join(parts).replace("|", "\\|")


def op_table_markdown() -> str:
    """The op table as markdown (docs/INTERFACES.md embeds it verbatim)."""
    lines = ["| op | code | request fields (in wire order) | reply | what |",
             "|---|---|---|---|---|"]
    for spec in sorted(OPS.values(), key=lambda s: s.op):
        lines.append(f"| {spec.op.name} | {int(spec.op)} | {_fields(spec.request)} | "
                     f"{spec.reply.__name__}({_fields(spec.reply)}) | {spec.summary} |"
                     .replace("()", ""))
    lines.append("")
    lines.append("| type | fields (in wire order) |")
    lines.append("|---|---|")
    for cls in (SegmentDescriptor, ReplicaDescriptor, PutOptions, SegmentInfo, TierTask):
        lines.append(f"| {cls.__name__} | {_fields(cls)} |")
    return "\n".join(lines)


if __name__ == "__main__":  # print the table of the imported module (not of __main__'s copy)
    from kvpool.core import protocol

    print(protocol.op_table_markdown())

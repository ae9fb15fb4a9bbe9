"""``kvpool status --json`` keeps its documented shape (docs/status_json.md).

The shape of schema version ``STATUS_SCHEMA`` is checked in next to this file
(``status_schema.json``: every key and the JSON type of its value,
recursively). The test runs the real command against a real LocalCluster and
compares what it prints with that file, and the file with the digest of the
released version, so a key added, removed or renamed, or a type changed, fails
here unless the change is announced: a new ``STATUS_SCHEMA`` in
cluster/status_cli.py, the file's ``schema`` and shape, its digest below and
the change described in docs/status_json.md.

Shape notation: ``"int"``, ``"float"``, ``"str"``, ``"bool"``, ``"null"``,
alternatives joined by ``|``; ``"object"`` a mapping whose contents are free
(transport-specific data); a mapping lists every key (a key ending ``?`` may
be absent); a list of one shape is an array whose every item has it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool.cluster import LocalCluster
from kvpool.cluster.status_cli import _INSTANCE_KEYS, STATUS_SCHEMA, status_document
from kvpool.core.protocol import ListSegments, Stats

pytestmark = pytest.mark.timeout(120)

SCHEMA_FILE = Path(__file__).with_name("status_schema.json")
#: sha256 of each released shape (the canonical JSON of the file's "shape")
DIGESTS = {1: "d2e65d6a0b5b6fa04a6767eb2c146e1bf3dff4f4617dcc3fe8df496bba0e58c5",
           2: "2e483a7f71639691fdcafc8b188a0337cda4d20a50616ebf577d54924f3e54a0",
           3: "f7640cd80fa2d838b05d563253ad85b375ebfb13b46dfffca59066719dbc55e2",
           4: "cd4d64bd745ad302af9ff3b9f0f4958136acf6d77f3753a0e47fded5f749bed7"}
_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "float": float, "str": str, "bool": bool, "null": type(None), "object": dict}


def digest(shape: Any) -> str:
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


def mismatches(value: Any, shape: Any, path: str = "$") -> list[str]:
    """Where ``value`` departs from ``shape`` (empty: it has the shape)."""
    if isinstance(shape, str):
        names = shape.split("|")
        unknown = [n for n in names if n not in _TYPES]
        if unknown:
            return [f"{path}: unknown type {unknown} in the schema"]
        # bool is an int to Python, not to JSON
        if any(type(value) is _TYPES[n] for n in names):
            return []
        return [f"{path}: {type(value).__name__} {value!r:.60}, expected {shape}"]
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__}, expected an array"]
        return [m for i, item in enumerate(value) for m in mismatches(item, shape[0],
                                                                       f"{path}[{i}]")]
    if not isinstance(value, dict):
        return [f"{path}: {type(value).__name__}, expected a mapping"]
    keys = {k.rstrip("?"): k.endswith("?") for k in shape}
    out = [f"{path}.{k}: a key the schema does not have" for k in value if k not in keys]
    out += [f"{path}.{k}: missing" for k, optional in keys.items()
            if k not in value and not optional]
    for k, sub in shape.items():
        name = k.rstrip("?")
        if name in value:
            out += mismatches(value[name], sub, f"{path}.{name}")
    return out


def _schema() -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    assert spec["schema"] == STATUS_SCHEMA, "status_schema.json is not the current version"
    assert digest(spec["shape"]) == DIGESTS.get(STATUS_SCHEMA), (
        "the status JSON's shape changed without a new version: raise STATUS_SCHEMA "
        "(cluster/status_cli.py) and the file's schema, add the new digest here, and say what "
        "changed in docs/status_json.md")
    return spec


def test_status_json_has_the_documented_shape() -> None:
    spec = _schema()
    with LocalCluster(nodes=2, memory="16MiB") as cluster:
        out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "status", "--master",
                              cluster.address, "--json"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        with cluster.master.client() as mc:
            stats, segments = mc.call(Stats()), mc.call(ListSegments()).segments
    doc = json.loads(out.stdout)
    assert doc["schema"] == STATUS_SCHEMA
    assert len(doc["segments"]) == 2 and "instances" not in doc
    assert mismatches(doc, spec["shape"]) == []
    # the convenience ids at the top are the descriptor's
    for row in doc["segments"]:
        assert row["host_id"] == row["descriptor"]["host_id"]
        assert row["segment_id"] == row["descriptor"]["segment_id"]
    # a master group's instances (rows as group_instances makes them)
    leader = dict.fromkeys(_INSTANCE_KEYS)
    leader.update(instance_id="a:1", address="a:1", role="leader", epoch=3, lsn=9, objects=0,
                  lag=0)
    lost = dict.fromkeys(_INSTANCE_KEYS)
    lost.update(instance_id="b:1", address="b:1", role="unreachable", error="refused")
    group = json.loads(json.dumps(status_document(stats, segments, [leader, lost]), default=str))
    assert mismatches(group, spec["shape"]) == []


def _sample(shape: Any) -> Any:
    """A value of ``shape`` (every optional key present)."""
    if isinstance(shape, str):
        return {"int": 0, "float": 0.0, "str": "", "bool": False, "null": None,
                "object": {}}[shape.split("|")[0]]
    if isinstance(shape, list):
        return [_sample(shape[0])]
    return {k.rstrip("?"): _sample(v) for k, v in shape.items()}


def test_an_unannounced_change_is_caught() -> None:
    shape = _schema()["shape"]
    doc = _sample(shape)
    assert mismatches(doc, shape) == []
    for change in ("add", "remove", "rename", "retype", "nested"):
        bad = copy.deepcopy(doc)
        stats = bad["stats"]
        if change == "add":
            stats["new_counter"] = 0
        elif change == "remove":
            del stats["objects"]
        elif change == "rename":
            stats["object_count"] = stats.pop("objects")
        elif change == "retype":
            stats["objects"] = "0"
        else:
            bad["segments"][0]["descriptor"]["host"] = bad["segments"][0]["descriptor"].pop(
                "host_id")
        assert mismatches(bad, shape), change
    assert digest({**shape, "extra_key": "int"}) != digest(shape)

"""Config documentation rendered from config dataclasses.

``configs/master.yaml``, ``configs/client.yaml`` and the key table of
docs/vllm.md are this module's output (``python scripts/config_docs.py``
writes them): every field, in declaration order, with its help text
(:func:`kvpool.core.config.setting`) and its default. The help text is thereby
written once for the command line, the YAML and the docs alike;
tests/core/test_config_docs.py fails when a file is stale.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import textwrap
import typing
from typing import Any

from kvpool.core.config import exact_size, is_size_field

__all__ = ["render_markdown_table", "render_yaml", "yaml_value"]

WIDTH = 92


def yaml_value(f: dataclasses.Field[Any]) -> str:
    """The default of field ``f`` as YAML text (sizes as ``64MiB``)."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        value = f.default
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and is_size_field(f):
        return exact_size(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict | list):
        return json.dumps(value)
    return repr(value)


def _comment(text: str, indent: int) -> list[str]:
    pad = " " * indent
    return [f"{pad}# {line}" for line in textwrap.wrap(text, WIDTH - indent - 2)]


def render_yaml(cls: type, header: str = "", *, indent: int = 0) -> str:
    """YAML text documenting every init field of dataclass ``cls``."""
    lines: list[str] = []
    if header:
        lines += [f"# {line}".rstrip() for line in header.strip("\n").splitlines()]
    hints = typing.get_type_hints(cls)
    pad = " " * indent
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if indent == 0 and lines:
            lines.append("")
        lines += _comment(str(f.metadata.get("help") or ""), indent)
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            lines.append(f"{pad}{f.name}:")
            lines.append(render_yaml(tp, indent=indent + 2).rstrip("\n"))
        else:
            lines.append(f"{pad}{f.name}: {yaml_value(f)}")
    return "\n".join(lines) + "\n"


def render_markdown_table(cls: type) -> str:
    """A ``| key | default | meaning |`` table of dataclass ``cls``'s init fields."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        shown = yaml_value(f)
        if shown.startswith('"'):
            shown = json.loads(shown)
        meaning = str(f.metadata.get("help") or "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{shown}` | {meaning} |")
    return "\n".join(rows) + "\n"

"""Command-line flags generated from config dataclasses.

A setting is declared once, as a dataclass field (:func:`kvpool.core.config.setting`
gives it its help text and, where it differs from ``--field-name``, its flag).
:func:`add_config_flags` turns the fields into argparse flags, and
:func:`config_from_flags` loads the dataclass from a YAML file with the flags
that were given laid on top, through the same loader (and size parser) as the
YAML. A flag that was not given leaves the file's value (or the default) alone.

Fields of a nested config dataclass (``tiering``, ``curve``) become
``--parent-field`` flags in an argument group; list, dict and ``Any`` fields
are YAML-only. Values reach the loader as the strings typed, so a bad value is
a :class:`~kvpool.core.config.ConfigError` naming the key, like one in a file;
booleans are ``--x`` / ``--no-x`` pairs, enums and ``choices`` are checked by
argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvpool.core.config import (
    exact_size,
    is_size_field,
    load_dataclass,
    load_yaml_mapping,
    merge_settings,
)

__all__ = ["add_config_flags", "config_from_flags", "flag_settings"]

T = TypeVar("T")

_DEST = "config:"  # argparse dest prefix of generated flags: "config:tiering.promote_after_hits"


class _MapChoice(argparse.Action):
    """Stores the value a command-line word stands for (``--curve auto`` -> None)."""

    def __init__(self, option_strings: list[str], dest: str, *, mapping: Mapping[str, Any],
                 **kwargs: Any) -> None:
        self.mapping = dict(mapping)
        super().__init__(option_strings, dest, choices=list(self.mapping), **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.mapping[values])


def _non_none(tp: Any) -> Any:
    """``X`` for ``X | None``; ``tp`` itself otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_scalar(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_is_scalar(a) for a in typing.get_args(tp))
    return tp in (str, int, float, bool, type(None)) or (
        isinstance(tp, type) and issubclass(tp, enum.Enum))


def _show_default(f: dataclasses.Field[Any]) -> str | None:
    if f.default is dataclasses.MISSING:
        return None
    value = f.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    if isinstance(value, int) and is_size_field(f):
        return exact_size(value)
    return str(value)


def _help(f: dataclasses.Field[Any]) -> str:
    text = str(f.metadata.get("help") or "")
    shown = _show_default(f)
    if shown is not None and shown != "":
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text.replace("%", "%%")


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, prefix: str = "",
                     title: str | None = None) -> None:
    """Add a flag for every command-line field of dataclass ``cls`` to ``parser``.

    A field's flag is its ``flag`` metadata or ``--`` + its dotted path with
    dashes (``--tiering-promote-after-hits``), plus its ``aliases``. A flag
    string the parser already has is skipped: a subcommand's own flag (one
    with custom parsing) wins over the generated one. Nested dataclass fields
    get an argument group titled by the field's help.
    """
    hints = typing.get_type_hints(cls)
    target: Any = parser.add_argument_group(title) if title else parser
    taken = parser._option_string_actions  # shared by the parser and its groups
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not f.init or not meta.get("cli", True):
            continue
        tp = hints[f.name]
        path = prefix + f.name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            add_config_flags(parser, tp, prefix=path + ".", title=meta.get("help") or path)
            continue
        if not _is_scalar(tp):
            continue  # lists, mappings: YAML only
        base = _non_none(tp)
        is_bool = base is bool and not meta.get("choices")
        names = [meta.get("flag") or "--" + path.replace(".", "-").replace("_", "-"),
                 *meta.get("aliases", ())]
        # a boolean's flag also brings its --no- form: both must be free
        names = [n for n in names if n not in taken
                 and not (is_bool and "--no-" + n[2:] in taken)]
        if not names:
            continue
        kw: dict[str, Any] = {"dest": _DEST + path, "default": argparse.SUPPRESS,
                              "help": _help(f)}
        if meta.get("choices"):
            target.add_argument(*names, action=_MapChoice, mapping=meta["choices"], **kw)
        elif is_bool:
            target.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            target.add_argument(*names, choices=[str(m.value) for m in base], **kw)
        else:
            metavar = "SIZE" if is_size_field(f) else f.name.upper()
            target.add_argument(*names, metavar=metavar, **kw)


def flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as generated flags, as a nested mapping
    (``{"port": "0", "tiering": {"promote_after_hits": "1"}}``)."""
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(_DEST):
            continue
        *parents, leaf = dest[len(_DEST):].split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def config_from_flags(cls: type[T], args: argparse.Namespace,
                      path: str | Path | None = None) -> T:
    """``cls`` from its defaults, the YAML at ``path`` (if any), then the flags given.

    Raises :class:`~kvpool.core.config.ConfigError` naming a bad key or value.
    """
    base = load_yaml_mapping(path) if path else {}
    return load_dataclass(cls, merge_settings(base, flag_settings(args)))

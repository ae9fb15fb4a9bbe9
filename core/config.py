"""Small helpers every layer uses: sizes, durations, YAML configs for dataclasses."""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "ConfigError",
    "check_settings",
    "exact_size",
    "format_size",
    "is_size_field",
    "load_dataclass",
    "load_yaml_mapping",
    "merge_settings",
    "parse_size",
    "setting",
    "setup_logging",
]

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]?i?B?|)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KIB": 1024, "KI": 1024,
    "M": 1000**2, "MB": 1000**2, "MIB": 1024**2, "MI": 1024**2,
    "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "GI": 1024**3,
    "T": 1000**4, "TB": 1000**4, "TIB": 1024**4, "TI": 1024**4,
    "P": 1000**5, "PB": 1000**5, "PIB": 1024**5, "PI": 1024**5,
}


class ConfigError(KVPoolError):
    """A configuration file or flag is invalid (unknown key, wrong type, bad value)."""

    code = ErrorCode.CONFIG_ERROR


def parse_size(value: str | int | float, *, binary_units: bool = False) -> int:
    """Parse ``4GiB``, ``512MiB``, ``1GB``, ``4096`` or an int into bytes.

    ``K``/``KB``, ``M``/``MB``, ... are powers of 1000, ``KiB``, ``MiB``, ...
    powers of 1024; with ``binary_units`` (Mooncake's reading of its setup
    arguments) all of them are powers of 1024. Raises :class:`ConfigError`.
    """
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must be >= 0: {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != int(value):
            raise ConfigError(f"size must be a whole number of bytes: {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"not a size: {value!r} (use e.g. 4GiB, 512MiB, 1GB, 4096)")
    number, unit = m.group(1), m.group(2).upper()
    if unit not in _UNITS:
        raise ConfigError(f"unknown size unit in {value!r}")
    if binary_units and unit and unit != "B":
        unit = unit[0] + "IB"
    result = float(number) * _UNITS[unit]
    if result != int(result):
        raise ConfigError(f"size is not a whole number of bytes: {value!r}")
    return int(result)


def exact_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it: 67108864 -> '64MiB'
    (what :func:`parse_size` reads back to the same number)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def format_size(n: int) -> str:
    """Human-readable binary size: 1536 -> '1.5KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{n}B"


def setting(default: Any = dataclasses.MISSING, *, help: str,
            default_factory: Any = dataclasses.MISSING, flag: str | None = None,
            aliases: tuple[str, ...] = (), choices: Mapping[str, Any] | None = None,
            size: bool = False, cli: bool = True, gt: float | None = None,
            ge: float | None = None, lt: float | None = None,
            le: float | None = None) -> Any:
    """A config dataclass field that carries its own description.

    The default is written here and nowhere else; ``help`` is the one
    description of the setting (command-line help is generated from it, see
    :mod:`kvpool.core.flags`). ``flag`` is its command-line spelling when that
    is not ``--field-name`` (``--parent-field-name`` inside a nested config),
    ``aliases`` further spellings, ``choices`` maps command-line words onto
    values (``{"auto": None, "on": True}``), ``size`` marks a byte count, which
    also accepts size strings such as ``4GiB``; ``cli=False`` keeps it off
    the command line (YAML only). ``gt``/``ge``/``lt``/``le`` bound a number
    (> / >= / < / <=), checked by :func:`check_settings`.
    """
    metadata = {"help": help, "flag": flag, "aliases": aliases, "choices": choices,
                "size": size, "cli": cli,  # "size" present: the name heuristic is off
                "bounds": tuple((op, v) for op, v in (("gt", gt), ("ge", ge), ("lt", lt),
                                                       ("le", le)) if v is not None)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def is_size_field(f: dataclasses.Field[Any]) -> bool:
    """Whether config field ``f`` holds a byte count that may be written ``4GiB``:
    its ``size`` metadata (:func:`setting`), else a name ending ``_size``/``_bytes``."""
    if "size" in f.metadata:
        return bool(f.metadata["size"])
    return f.name.endswith(("_size", "_bytes")) or f.name in ("memory", "disk")


_BOUND_CHECKS = {"gt": (float.__gt__, ">"), "ge": (float.__ge__, ">="),
                 "lt": (float.__lt__, "<"), "le": (float.__le__, "<=")}


def _has_type(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of config field type ``tp`` as a built config holds
    it (no conversion: ``"64"`` is not an int; an int is a float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in typing.get_args(tp))
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is bool:
        return type(value) is bool
    if tp is int:
        return isinstance(value, int) and type(value) is not bool
    if tp is float:
        return isinstance(value, int | float) and type(value) is not bool
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(tp, type) and isinstance(value, tp)


def check_settings(obj: Any) -> None:
    """Raise :class:`ConfigError` naming the first field of config dataclass
    ``obj`` whose value is not of its declared type or lies outside the bounds
    its :func:`setting` declares. A ``validate()`` method calls it first and
    keeps only the checks that span fields."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _has_type(value, hints[f.name]):
            tp = hints[f.name]
            name = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
            raise ConfigError(f"{f.name}: expected {name}, got {value!r}")
        for op, bound in f.metadata.get("bounds", ()):
            check, sign = _BOUND_CHECKS[op]
            if value is not None and not check(float(value), float(bound)):
                raise ConfigError(f"{f.name} must be {sign} {bound:g}, got {value!r}")


def merge_settings(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on top, nested mappings merged key by key.
    Unlike ``load_dataclass``'s overrides, a ``None`` in ``over`` is a value."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge_settings(out[k], v)
        else:
            out[k] = v
    return out


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Check/convert one config value against its dataclass field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, arg, value)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{name}: {value!r} matches none of {args}")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
        return load_dataclass(tp, value, prefix=f"{name}.")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}: expected a list, got {type(value).__name__}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(f"{name}[{i}]", item_tp, v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value, 0)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = tp.__members__
        try:
            if isinstance(value, str) and value.upper() in members:
                return members[value.upper()]
            return tp(value)
        except (KeyError, ValueError) as exc:
            names = ", ".join(m.lower() for m in members)
            raise ConfigError(f"{name}: {value!r} is not one of {names}") from exc
    return value


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of the YAML file at ``path`` (an empty file is ``{}``).
    An unreadable file, invalid YAML or a top level that is not a mapping raises
    :class:`ConfigError` naming the file."""
    p = Path(path)
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {p}: {exc}") from exc
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"{p}: top level must be a mapping")
    return dict(loaded)


def load_dataclass(
    cls: type[T],
    data: Mapping[str, Any] | str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    prefix: str = "",
) -> T:
    """Build dataclass ``cls`` from a mapping or a YAML file, plus overrides.

    Unknown keys, wrong types and bad values raise :class:`ConfigError`
    naming the key. Size fields (:func:`is_size_field`, typed int) also
    accept size strings such as ``4GiB``. ``None`` overrides are ignored so
    argparse defaults of ``None`` mean "keep the file's value".
    """
    if data is None:
        mapping: dict[str, Any] = {}
    elif isinstance(data, str | Path):
        mapping = load_yaml_mapping(data)
    else:
        mapping = dict(data)
    for k, v in (overrides or {}).items():
        if v is not None:
            mapping[k] = v
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(prefix + u for u in unknown)}; "
            f"known: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for key, value in mapping.items():
        tp = hints[key]
        if tp is int and isinstance(value, str) and is_size_field(fields[key]):
            try:
                kwargs[key] = parse_size(value)
            except ConfigError as exc:
                raise ConfigError(f"{prefix}{key}: {exc}") from None
        else:
            kwargs[key] = _coerce(prefix + key, tp, value)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix or cls.__name__}: {exc}") from exc
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def setup_logging(level: str | int = "INFO") -> None:
    """Configure root logging once for a kvpool process."""
    logging.basicConfig(
        level=level if isinstance(level, int) else level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )

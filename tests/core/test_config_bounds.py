"""Settings declare their type and bounds once; check_settings enforces both
on a built config (direct construction included, where no loader converts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from kvpool.core.config import ConfigError, check_settings, load_dataclass, setting


@dataclass
class _Cfg:
    count: int = setting(1, ge=1, le=8, help="a count")
    ratio: float = setting(0.5, gt=0, lt=1, help="a fraction")
    name: str | None = setting(None, help="a name")
    flag: bool = setting(False, help="a flag")
    extra: dict[str, int] = setting(default_factory=dict, help="a mapping")

    def validate(self) -> None:
        check_settings(self)


def test_values_in_bounds_pass() -> None:
    check_settings(_Cfg())
    check_settings(_Cfg(count=8, ratio=0.99, name="x", flag=True, extra={"a": 1}))
    assert load_dataclass(_Cfg, {"count": "3", "ratio": 1 / 4}).count == 3  # int for a float


@pytest.mark.parametrize(("field", "value", "words"), [
    ("count", 0, "count must be >= 1"),
    ("count", 9, "count must be <= 8"),
    ("ratio", 0, "ratio must be > 0"),
    ("ratio", 1.0, "ratio must be < 1"),
    ("count", "3", "count: expected int"),
    ("count", True, "count: expected int"),
    ("ratio", "0.5", "ratio: expected float"),
    ("name", 5, "name: expected str | None"),
    ("flag", 1, "flag: expected bool"),
    ("extra", [], "extra: expected dict"),
])
def test_a_wrong_type_or_a_value_out_of_bounds_names_the_field(field: str, value: object,
                                                                 words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        check_settings(dataclasses.replace(_Cfg(), **{field: value}))


def test_the_loader_checks_bounds_through_validate() -> None:
    with pytest.raises(ConfigError, match="count must be >= 1"):
        load_dataclass(_Cfg, {"count": 0})

"""Package attributes imported on first use (PEP 562).

A package whose names pull in heavy modules (the store client, process
managers) exports them lazily, so ``kvpool --help`` and a CLI subcommand start
fast: it declares which module holds each name and sets its module
``__getattr__`` from :func:`lazy_exports`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, modules: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name listed under a
    module of ``modules`` (module -> names) is imported from it when first
    asked for; any other name raises AttributeError."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__

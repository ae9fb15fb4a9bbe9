"""Chaos suite: skip everything here, with the reason, where namespaces cannot be built.

The probe (build and tear down a 2-host topology with a tbf qdisc) runs once
per session; leftovers of earlier runs that died are removed first.
"""

from __future__ import annotations

import pytest

from support.netns import cleanup_stale, probe

_reason: list[str | None] = []


def _probe_once() -> str | None:
    if not _reason:
        try:
            cleanup_stale()
        except Exception:  # a failing cleanup must not hide the probe's own reason
            pass
        _reason.append(probe())
    return _reason[0]


@pytest.fixture(autouse=True)
def _needs_netns() -> None:
    reason = _probe_once()
    if reason is not None:
        pytest.skip(f"chaos suite skipped: {reason}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.netns)

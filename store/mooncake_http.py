"""The client-local HTTP endpoints of Mooncake's store (``enable_client_http_server``).

``/health`` (200 ``OK`` when :meth:`health_check` is 0, else 503 with the
code), ``/metrics`` (Prometheus text: health and the pool's bytes and
objects as the master reports them) and ``/metrics/summary`` (the same as
JSON), served on the store's transfer-server address at ``client_http_port``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from kvpool.core.http import JSON, PROMETHEUS, TEXT, HttpEndpoints
from kvpool.store.mooncake_core import MooncakeCore

__all__ = ["ClientHttpServer"]

log = logging.getLogger(__name__)


class ClientHttpServer:
    """The client endpoints of one store (:class:`kvpool.core.http.HttpEndpoints`);
    ``close()`` stops them."""

    def __init__(self, core: MooncakeCore, health: Callable[[], int], host: str,
                 port: int) -> None:
        """Serve the store of ``core`` (``health``: its ``health_check``) on
        ``host:port``. Raises OSError when the port cannot be bound."""
        self._core = core
        self._health = health
        self._http = HttpEndpoints({"/health": self._health_route,
                                    "/metrics": self._metrics_route,
                                    "/metrics/summary": self._summary_route},
                                   host, port, "kvpool-mc-http")
        log.info("client HTTP endpoints on http://%s:%d/{health,metrics,metrics/summary}",
                 host, self._http.port)

    @property
    def port(self) -> int:
        return self._http.port

    def _summary(self) -> dict[str, Any]:
        code = self._health()
        out: dict[str, Any] = {"health": code, "hostname": self._core.hostname}
        client = self._core.client
        if client is not None and code == 0:
            try:
                stats = client.stats()
                for k in ("objects", "bytes_used", "bytes_capacity", "segments"):
                    out[k] = getattr(stats, k)
            except Exception as exc:  # the summary must answer even when the master does not
                out["error"] = str(exc)
        return out

    def _health_route(self) -> tuple[int, str, str]:
        code = self._health()
        return (200, "OK", TEXT) if code == 0 else (503, f"{code}\n", TEXT)

    def _metrics_route(self) -> tuple[int, str, str]:
        s = self._summary()
        lines = [f"kvpool_mooncake_client_health {s['health']}"]
        lines += [f"kvpool_pool_{k} {s[k]}" for k in ("objects", "bytes_used",
                                                      "bytes_capacity", "segments") if k in s]
        return 200, "\n".join(lines) + "\n", PROMETHEUS

    def _summary_route(self) -> tuple[int, str, str]:
        return 200, json.dumps(self._summary()), JSON

    def close(self) -> None:
        self._http.close()

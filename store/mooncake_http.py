"""The client-local HTTP endpoints of Mooncake's store (``enable_client_http_server``).

``/health`` (200 ``OK`` when :meth:`health_check` is 0, else 503 with the
code), ``/metrics`` (Prometheus text: health and the pool's bytes and
objects as the master reports them) and ``/metrics/summary`` (the same as
JSON), served on the store's transfer-server address at ``client_http_port``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpool.store.mooncake_core import MooncakeCore

__all__ = ["ClientHttpServer"]

log = logging.getLogger(__name__)


class ClientHttpServer:
    """A small threaded HTTP server for one store; ``close()`` stops it."""

    def __init__(self, core: MooncakeCore, health: Callable[[], int], host: str,
                 port: int) -> None:
        """Serve the store of ``core`` (``health``: its ``health_check``) on
        ``host:port``. Raises OSError when the port cannot be bound."""
        self._core = core
        self._health = health
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer._serve(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("client http: " + fmt, *args)

        self._httpd = ThreadingHTTPServer((host, int(port)), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="kvpool-mc-http", daemon=True)
        self._thread.start()
        log.info("client HTTP endpoints on http://%s:%d/{health,metrics,metrics/summary}",
                 host, self._httpd.server_address[1])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

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

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            code = self._health()
            self._reply(req, 200 if code == 0 else 503, "OK" if code == 0 else f"{code}\n")
        elif path == "/metrics":
            s = self._summary()
            lines = [f"kvpool_mooncake_client_health {s['health']}"]
            lines += [f"kvpool_pool_{k} {s[k]}" for k in ("objects", "bytes_used",
                                                          "bytes_capacity", "segments") if k in s]
            self._reply(req, 200, "\n".join(lines) + "\n", "text/plain; version=0.0.4")
        elif path == "/metrics/summary":
            self._reply(req, 200, json.dumps(self._summary()), "application/json")
        else:
            self._reply(req, 404, "not found\n")

    @staticmethod
    def _reply(req: BaseHTTPRequestHandler, status: int, body: str,
               ctype: str = "text/plain") -> None:
        data = body.encode()
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

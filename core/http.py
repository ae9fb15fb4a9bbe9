"""Small HTTP endpoints (metrics, health) served from a background thread.

The master's ``/metrics`` and ``/health``, a node daemon's, and the
Mooncake-compatible store's client endpoints are each a table of routes:
path -> a function answering ``(status, body, content type)``. An unknown
path is 404; a route that raises is 500 with the error (the server keeps
serving). Paths match with or without a trailing slash.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["JSON", "PROMETHEUS", "TEXT", "HttpEndpoints", "Route"]

log = logging.getLogger(__name__)

TEXT = "text/plain"
JSON = "application/json"
PROMETHEUS = "text/plain; version=0.0.4"

#: a route: ``() -> (status, body, content type)``
Route = Callable[[], tuple[int, bytes | str, str]]


class HttpEndpoints:
    """A threaded HTTP server answering GET on ``routes`` at ``host:port``
    (0: a free port; :attr:`port` says which). Raises OSError when the port
    cannot be bound. ``close()`` stops it."""

    def __init__(self, routes: Mapping[str, Route], host: str, port: int,
                 name: str = "kvpool-http") -> None:
        table = {p.rstrip("/") or "/": fn for p, fn in routes.items()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = table.get(self.path.split("?", 1)[0].rstrip("/") or "/")
                if route is None:
                    _reply(self, 404, b"not found\n", TEXT)
                    return
                try:
                    status, body, ctype = route()
                except Exception as exc:  # one broken route must not stop the others
                    log.warning("%s %s: %s", name, self.path, exc)
                    status, body, ctype = 500, f"error: {exc}\n", TEXT
                _reply(self, status, body, ctype)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug(f"{name}: {format}", *args)

        self._httpd = ThreadingHTTPServer((host, int(port)), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=name,
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()


def _reply(req: BaseHTTPRequestHandler, status: int, body: bytes | str, ctype: str) -> None:
    data = body.encode() if isinstance(body, str) else body
    req.send_response(status)
    req.send_header("Content-Type", ctype)
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    req.wfile.write(data)

"""The metrics port (TGI's `--prometheus-port`): a plain HTTP listener that answers every GET with
the same exposition as the `Metrics` RPC. It runs on its own threads, so a scrape never waits for
the event loop and a busy loop never delays a scrape."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)


class MetricsServer:
    """`render()` → (content type, body), served on host:port until `stop()`."""

    def __init__(self, host: str, port: int, render: Callable[[], tuple[str, bytes]]):
        handler = type("MetricsHandler", (_Handler,), {"render": staticmethod(render)})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type(
            "MetricsHTTPServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True}
        )
        self._server = server_class((host.strip("[]"), port), handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    render: Callable[[], tuple[str, bytes]]

    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        content_type, body = self.render()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 — scrapes are not news
        logger.debug("metrics scrape from %s: " + format, self.client_address[0], *args)

"""The publisher's HTTP endpoints: ``/metrics``, ``/healthz`` and ``/readyz``.

A small ``ThreadingHTTPServer`` in a daemon thread, so that a slow scrape
never holds up the publisher loop and a stuck loop never holds up a probe:

* ``/metrics``: every metric of the publisher's own registry, in the
  Prometheus text format;
* ``/healthz``: 200 while the process and its loop are alive, else 503;
* ``/readyz``: 200 when the publisher is registered, its last database and
  Kafka contacts succeeded and its loop moves, else 503; the JSON body names
  each check and why it fails.

Any other path is 404. Only GET and HEAD are served.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from publisher.health import Health, Verdict

log = logging.getLogger(__name__)


class EndpointServer:
    """Serves the endpoints on ``host:port`` from a daemon thread until ``stop()``.

    The socket is bound in the constructor, so an address in use fails the
    start at once (``OSError``) instead of later in a thread nobody watches.
    ``port`` 0 binds a free port; ``address`` says which.
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Health) -> None:
        handler = _handler(registry, health)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The host and port actually bound."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Serve requests in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="outbox-http",
                daemon=True,
            )
            self._thread.start()
            host, port = self.address
            log.info("serving /metrics, /healthz and /readyz on http://%s:%d", host, port)

    def stop(self) -> None:
        """Stop serving and close the socket; returns once the serving thread has ended."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()


def _handler(registry: CollectorRegistry, health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "outbox-publisher"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._verdict(health.liveness())
            elif path == "/readyz":
                self._verdict(health.readiness())
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

        def do_HEAD(self) -> None:
            self.do_GET()

        def _verdict(self, verdict: Verdict) -> None:
            status = HTTPStatus.OK if verdict.ok else HTTPStatus.SERVICE_UNAVAILABLE
            body = json.dumps(verdict.as_json()).encode() + b"\n"
            self._send(status, body, "application/json")

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            # Probes arrive every few seconds; the default writes each to stderr.
            log.debug("%s " + format, self.address_string(), *args)

    return Handler

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
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from publisher.health import Health, Verdict
from publisher.service import BackgroundService

log = logging.getLogger(__name__)


#: How long one turn waits for a request: the longest ``stop()`` waits for an idle server.
POLL_SECONDS = 0.2


class EndpointServer(BackgroundService):
    """Serves the endpoints on ``host:port`` from a daemon thread until ``stop()``.

    The socket is bound in the constructor, so an address in use fails the
    start at once (``OSError``) instead of later in a thread nobody watches.
    ``port`` 0 binds a free port; ``address`` says which. A turn serves one
    request, or none within ``POLL_SECONDS``; each request is answered in a
    thread of its own, so a slow client holds up nothing.
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Health) -> None:
        # No wait between turns: each turn waits on the socket instead.
        super().__init__(name="outbox-http", interval=0.0, join_timeout=5)
        handler = _handler(registry, health)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._server.timeout = POLL_SECONDS

    @property
    def address(self) -> tuple[str, int]:
        """The host and port actually bound."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Serve requests in a daemon thread."""
        if not self.running and not self.stopping:
            super().start()
            host, port = self.address
            log.info("serving /metrics, /healthz and /readyz on http://%s:%d", host, port)

    def run_once(self) -> None:
        """Serve one request, or return after ``POLL_SECONDS`` without one."""
        self._server.handle_request()

    def stop(self, timeout: float | None = None) -> None:
        """Stop serving and close the socket; returns once the serving thread has ended."""
        super().stop(timeout)
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

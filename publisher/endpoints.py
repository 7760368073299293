"""The publisher's HTTP endpoints: ``/metrics``, ``/healthz`` and ``/readyz``.

Served beside the loop, so that a slow scrape never holds up the publisher
and a stuck loop never holds up a probe:

* ``/metrics``: every metric of the publisher's own registry, in the
  Prometheus text format;
* ``/healthz``: 200 while the process and its loop are alive, else 503;
* ``/readyz``: 200 when the publisher is registered, its last database and
  Kafka contacts succeeded and its loop moves, else 503; the JSON body gives
  each check a short code (``publisher.health.CODES``), never an error's text.

Any other path is 404. Only GET and HEAD are served, one request per
connection (HTTP/1.0), with no authentication: the answers hold nothing but
codes and counts (docs/security.md).

The endpoints must answer a probe even while clients misbehave, so a request
costs a thread only once it has fully arrived:

* one thread accepts connections and reads their requests, without blocking
  on any of them; a connection whose request has not fully arrived within
  ``REQUEST_TIMEOUT`` seconds of its accept, or is larger than
  ``MAX_REQUEST_BYTES``, is closed;
* at most ``MAX_CONNECTIONS`` connections wait for their request at once; one
  more closes the oldest waiting connection, so idle connections cannot lock
  a probe out;
* a probe (a GET or HEAD of ``/healthz`` or ``/readyz``) is answered by the
  accepting thread as soon as it has arrived, from memory;
* ``WORKERS`` threads answer every other request that arrived (``/metrics``,
  and whatever else came), in order; a response the client does not read
  within ``REQUEST_TIMEOUT`` seconds is dropped.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import queue
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from publisher.health import Health, Verdict
from publisher.service import BackgroundService

log = logging.getLogger(__name__)


#: How long one turn waits for sockets to be ready: the longest ``stop()`` waits for an idle
#: server.
POLL_SECONDS = 0.2
#: Threads that answer every request but a probe (``/metrics``: the outbox status gauges
#: may wait on the database; probes are answered by the accepting thread, from memory,
#: and never wait for them).
WORKERS = 4
#: Connections that may wait for their request to arrive; one more closes the oldest.
MAX_CONNECTIONS = 256
#: Seconds a client has to send its request, and then to read the answer.
REQUEST_TIMEOUT = 5.0
#: The largest request (request line and headers) read; a larger one is closed.
MAX_REQUEST_BYTES = 8192
#: Requests that arrived and wait for a worker; more are answered 503 at once.
QUEUE_SIZE = 64
#: The paths of the probes, the only requests the accepting thread answers itself.
PROBE_PATHS = ("/healthz", "/readyz")

_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 5\r\nConnection: close\r\n\r\nbusy\n"
)


@dataclass
class _Waiting:
    """A connection whose request is still arriving."""

    sock: socket.socket
    address: tuple[Any, ...]
    deadline: float
    data: bytearray = field(default_factory=bytearray)


class EndpointServer(BackgroundService):
    """Serves the endpoints on ``host:port`` until ``stop()``: one accepting thread, workers.

    The socket is bound in the constructor, so an address in use fails the
    start at once (``OSError``) instead of later in a thread nobody watches.
    ``port`` 0 binds a free port; ``address`` says which. A turn (``run_once``)
    accepts and reads what is ready within ``POLL_SECONDS``; a probe that
    has fully arrived is answered in the turn, any other request goes to a
    worker, or, before ``start()``, is answered in the turn itself.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Health,
        *,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        # No wait between turns: each turn waits on the sockets instead.
        super().__init__(name="outbox-http", interval=0.0, join_timeout=5)
        self._handler = _handler(registry, health, request_timeout)
        # The accepting thread's: it has no registry, so it can never be made to
        # run a scrape, whatever a request looks like (_is_probe decides).
        self._probe_handler = _handler(None, health, request_timeout)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=1024)
        self._listener.setblocking(False)
        self._workers_wanted = workers
        self._max_connections = max_connections
        self._request_timeout = request_timeout
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._waiting: OrderedDict[socket.socket, _Waiting] = OrderedDict()
        self._requests: queue.Queue[tuple[socket.socket, tuple[Any, ...], bytes] | None] = (
            queue.Queue(QUEUE_SIZE)
        )
        self._workers: list[threading.Thread] = []
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """The host and port actually bound."""
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Accept in a daemon thread, answer in ``workers`` more."""
        if not self.running and not self.stopping:
            for i in range(self._workers_wanted):
                worker = threading.Thread(
                    target=self._work, name=f"outbox-http-worker-{i}", daemon=True
                )
                worker.start()
                self._workers.append(worker)
            super().start()
            host, port = self.address
            log.info("serving /metrics, /healthz and /readyz on http://%s:%d", host, port)

    def run_once(self) -> None:
        """Accept and read what is ready within ``POLL_SECONDS``; pass on complete requests."""
        for key, _ in self._selector.select(POLL_SECONDS):
            if key.fileobj is self._listener:
                self._accept()
            else:
                assert isinstance(key.fileobj, socket.socket)
                self._read(key.fileobj)
        now = time.monotonic()
        while self._waiting:
            oldest = next(iter(self._waiting.values()))
            if oldest.deadline > now:
                break
            self._drop(oldest.sock)

    def stop(self, timeout: float | None = None) -> None:
        """Stop serving and close every socket; returns once the threads have ended."""
        super().stop(timeout)
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._requests.put(None)
        for worker in self._workers:
            worker.join(self._request_timeout + 1)
        for sock in list(self._waiting):
            self._drop(sock)
        self._selector.close()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: try again next turn
                log.warning("HTTP endpoints: cannot accept a connection: %s", exc)
                return
            sock.setblocking(False)
            if len(self._waiting) >= self._max_connections:
                self._drop(next(iter(self._waiting)))
            self._waiting[sock] = _Waiting(sock, address, time.monotonic() + self._request_timeout)
            self._selector.register(sock, selectors.EVENT_READ)
            self._read(sock)  # a request sent with the connection is often there already

    def _read(self, sock: socket.socket) -> None:
        waiting = self._waiting.get(sock)
        if waiting is None:
            return
        try:
            chunk = sock.recv(MAX_REQUEST_BYTES + 1 - len(waiting.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sock)
            return
        if not chunk:  # the client went away
            self._drop(sock)
            return
        waiting.data += chunk
        if b"\r\n\r\n" in waiting.data or b"\n\n" in waiting.data:
            self._selector.unregister(sock)
            del self._waiting[sock]
            self._dispatch(sock, waiting.address, bytes(waiting.data))
        elif len(waiting.data) > MAX_REQUEST_BYTES:
            self._drop(sock)

    def _dispatch(self, sock: socket.socket, address: tuple[Any, ...], request: bytes) -> None:
        sock.setblocking(True)
        if _is_probe(request):
            # A probe is answered here, at once: its answer is made from memory
            # and small enough for the socket's buffer, so it never waits behind
            # scrapes that read the database.
            self._answer(self._probe_handler, sock, address, request)
            return
        if not self._workers:  # before start(): the turn answers it
            self._answer(self._handler, sock, address, request)
            return
        try:
            self._requests.put_nowait((sock, address, request))
        except queue.Full:
            # Every worker is busy and the queue full: say so rather than wait.
            with contextlib.suppress(OSError):  # it gets closed either way
                sock.settimeout(0)
                sock.send(_BUSY)
            _close(sock)

    def _drop(self, sock: socket.socket) -> None:
        """Close a connection whose request did not arrive (in time, or at all)."""
        self._waiting.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):  # not registered (any more)
            self._selector.unregister(sock)
        _close(sock)

    def _work(self) -> None:
        while (item := self._requests.get()) is not None:
            self._answer(self._handler, *item)

    def _answer(
        self,
        handler: type[BaseHTTPRequestHandler],
        sock: socket.socket,
        address: tuple[Any, ...],
        request: bytes,
    ) -> None:
        try:
            handler((sock, request), address, None)  # type: ignore[arg-type]
        except Exception:  # a bug: log it, keep serving
            log.exception("HTTP endpoints: answering a request failed")
        finally:
            _close(sock)


def _is_probe(request: bytes) -> bool:
    """Whether the request is a GET or HEAD of a probe's path, its request line read as
    the handler reads it (``BaseHTTPRequestHandler.parse_request``: latin-1, split by
    ``str.split``, which also splits on \\x1c-\\x1f, \\x85 and \\xa0).

    Only such a request is answered on the accepting thread. Anything else goes
    to the workers: a reading of the line that differed from the handler's
    could otherwise have the accepting thread serve a scrape.
    """
    line = str(request.split(b"\n", 1)[0], "iso-8859-1").rstrip("\r\n")
    words = line.split()
    return (
        len(words) == 3 and words[0] in ("GET", "HEAD") and words[1].split("?", 1)[0] in PROBE_PATHS
    )


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the client may have gone already
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _handler(
    registry: CollectorRegistry | None, health: Health, timeout: float
) -> type[BaseHTTPRequestHandler]:
    """A handler class; without a ``registry`` (the accepting thread's) it never scrapes:
    ``/metrics`` is answered 503."""

    class Handler(BaseHTTPRequestHandler):
        """Answers one request that has fully arrived; the answer is sent in one piece."""

        server_version = "outbox-publisher"
        # Short plain-text errors that do not echo the request back.
        error_message_format = "%(code)d %(explain)s\n"
        error_content_type = "text/plain; charset=utf-8"

        def setup(self) -> None:
            sock, data = self.request
            self.connection = sock
            self.rfile = io.BytesIO(data)
            self.answer = self.wfile = io.BytesIO()

        def finish(self) -> None:
            # One write, bounded as a whole by the timeout (socket.sendall since 3.5).
            self.connection.settimeout(timeout)
            try:
                self.connection.sendall(self.answer.getvalue())
            except OSError as exc:
                log.debug("%s: answer not sent: %s", self.address_string(), exc)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if registry is None:  # the accepting thread's handler: never a scrape
                    self.send_error(HTTPStatus.SERVICE_UNAVAILABLE)
                else:
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

        def send_error(
            self, code: int, message: str | None = None, explain: str | None = None
        ) -> None:
            """The standard reason phrase: the default one quotes the request ("Unsupported
            method ('FOO<b>')", "Bad request syntax (...)") in the status line."""
            super().send_error(code, None, explain)

        def log_message(self, format: str, *args: Any) -> None:
            # Probes arrive every few seconds; the default writes each to stderr.
            log.debug("%s " + format, self.address_string(), *args)

    return Handler

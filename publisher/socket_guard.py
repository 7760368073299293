"""No byte of a batch leaves a kafka-python producer after the batch's write deadline.

A publisher frozen (SIGSTOP, a long pause, a stalled VM) after handing its
batch to the producer may wake after its lease expired, after the reconciler
proved the batch absent and after a successor delivered it. The producer
would then write what it still buffers: a second copy. The fence in
PostgreSQL cannot stop that, since Kafka never sees it; the only place left
to enforce the deadline is the last step before the socket, in this process.

kafka-python writes every request through its transport's ``_sock_send``.
``install`` wraps that method once, for every transport class; the wrapper
does nothing for connections that carry no guard (the reconciler's consumer,
admin clients). A ``SocketGuard`` attaches itself to one producer's network
selector; while it is armed with a batch's ``SendWindow`` and the window's
write deadline has passed, the wrapper writes nothing: it drops the bytes
with the connection and force-closes the producer, so that every record it
still holds fails at once (reported as ``WriteDeadlinePassed``) instead of
being retried on a new connection.

What remains is the time between the check and ``socket.send`` (the same
thread, without blocking: microseconds), and bytes already given to the
kernel before the deadline, which TCP may still deliver; the absence grace
the reconciler waits past the write deadline covers those.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kafka import errors as kafka_errors
from kafka.net import transport as kafka_transport

if TYPE_CHECKING:
    from publisher.sink import SendWindow

log = logging.getLogger(__name__)

#: The attribute a guarded producer's network selector carries.
_ATTRIBUTE = "_outbox_socket_guard"
#: The transport classes whose socket writes are checked (the TLS one overrides the method).
_TRANSPORTS = ("KafkaTCPTransport", "KafkaSSLTransport")


class WriteDeadlinePassed(kafka_errors.KafkaError):  # type: ignore[misc]  # kafka-python is untyped
    """The batch's write deadline passed before the producer wrote it all; the rest was dropped.

    What was written before the deadline may be in the log: the outcome is
    uncertain, for the reconciler to decide.
    """


class SocketGuard:
    """Refuses one producer's socket writes once its batch's write deadline has passed."""

    def __init__(self, producer: Any) -> None:
        install()
        self._producer = producer
        self._window: SendWindow | None = None
        #: Set when the guard refused a write; the producer is closed by then.
        self.tripped = False
        try:
            selector = producer._sender._client._net
        except AttributeError as exc:  # a kafka-python whose internals moved
            raise RuntimeError(
                "cannot guard this kafka-python producer's socket writes (its network "
                f"client has no selector: {exc}); the publisher supports kafka-python 3.0"
            ) from exc
        setattr(selector, _ATTRIBUTE, self)

    def arm(self, window: SendWindow | None) -> None:
        """From now on, write only within ``window`` (``None``: no limit)."""
        self._window = window

    def disarm(self) -> None:
        """The armed batch was confirmed whole: the producer holds none of its bytes any more.

        Never after a record of it failed: kafka-python completes a batch's
        future (an expiry) and may still write the batch in the same turn.
        """
        self._window = None

    def may_write(self) -> bool:
        """Whether the producer may write to its sockets now."""
        window = self._window
        return not self.tripped and (window is None or window.may_write())

    def refuse(self) -> WriteDeadlinePassed:
        """Trip: close the producer without writing, and say why."""
        if not self.tripped:
            self.tripped = True
            log.error(
                "the batch's write deadline passed before the producer wrote it all "
                "(the process was paused or starved): nothing more is written, the "
                "producer is closed and the batch's outcome is uncertain"
            )
            # Flags only: the sender thread (this one) fails every batch it
            # still holds when its current turn ends, instead of retrying.
            self._producer._sender.force_close()
        return WriteDeadlinePassed("the batch's write deadline had passed; nothing more written")


def _guarded(send: Callable[[Any], tuple[int, Any]]) -> Callable[[Any], tuple[int, Any]]:
    """``_sock_send`` that first asks the producer's guard, if it has one."""

    @functools.wraps(send)
    def _sock_send(transport: Any) -> tuple[int, Any]:
        guard = getattr(transport._net, _ATTRIBUTE, None)
        if guard is not None and transport._write_buffer and not guard.may_write():
            # The transport aborts on an error: its buffered bytes are dropped.
            return 0, guard.refuse()
        return send(transport)

    _sock_send.outbox_guarded = True  # type: ignore[attr-defined]
    return _sock_send


def install() -> None:
    """Wrap the socket writes of kafka-python's transports (once; later calls do nothing)."""
    for name in _TRANSPORTS:
        cls = getattr(kafka_transport, name, None)
        send = getattr(cls, "_sock_send", None)
        if cls is None or send is None:
            raise RuntimeError(
                f"kafka-python has no {name}._sock_send to guard; the publisher supports "
                "kafka-python 3.0"
            )
        # Each class's own method: the TLS transport overrides the TCP one's.
        own = cls.__dict__.get("_sock_send")
        if own is not None and not getattr(own, "outbox_guarded", False):
            cls._sock_send = _guarded(own)

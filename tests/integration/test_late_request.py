"""A produce request that arrives after its transaction was aborted is never committed.

A record whose request went unanswered (the connection dropped, the request
timed out at the producer) is settled "not written" once its transaction
is aborted, and sent again. The request itself may still be on its way.
Arriving after the abort, it is appended to the partition; if the session
that sent it has by then begun its next transaction on that partition, the
broker takes it as part of that transaction and commits it beside the
record sent again: read_committed consumers read the message twice. So the
publisher leaves such a session (``may_land_after_abort``): a request of a
producer id with no transaction open is refused.

Here the request is held back on its way to the real broker (the producer's
transport drops it and the test delivers it later, on a connection of its
own), as a slow network would. The first test shows what leaving the
session prevents, and that the sink, left as the publisher leaves it,
commits the message once; the last that a sink closed with such a request
unanswered stops its producer.
"""

from __future__ import annotations

import socket
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from kafka.net import transport

from publisher.outcomes import TransactionEnd, may_land_after_abort
from publisher.sink import KafkaSink, KafkaSinkConfig, OutgoingRecord
from tests.support import create_topic, read_topic, wait_until

pytestmark = pytest.mark.integration

PRODUCE = 0  # the Produce request's API key


@dataclass
class HeldBack:
    """Produce requests for one topic: held back while ``holding``; delivered, on a
    connection of their own, just before the next one once ``late`` is set."""

    topic: str
    bootstrap: str
    holding: bool = False
    late: bool = False
    requests: list[bytes] = field(default_factory=list)

    def deliver(self) -> None:
        """Send what was held back to the broker now, and read its answers."""
        host, port = self.bootstrap.split(",")[0].rsplit(":", 1)
        for request in self.requests:
            with socket.create_connection((host, int(port)), timeout=10) as late:
                late.sendall(request)
                (size,) = struct.unpack(">i", _read(late, 4))
                _read(late, size)
        self.late = False


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the broker closed the connection"
        data += chunk
    return data


@pytest.fixture
def held_back(kafka_bootstrap: str) -> Iterator[HeldBack]:
    """A one-partition topic whose produce requests the producers' transport holds back."""
    name = f"outbox-late-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, name, partitions=1)
    held = HeldBack(name, kafka_bootstrap)
    write = transport.KafkaTCPTransport.write

    def holding_write(self: transport.KafkaTCPTransport, data: bytes) -> None:
        kept, at = [], 0
        data = bytes(data)
        while at + 4 <= len(data):
            (size,) = struct.unpack(">i", data[at : at + 4])
            request = data[at : at + 4 + size]
            at += 4 + size
            (api_key,) = struct.unpack(">h", request[4:6])
            if api_key == PRODUCE and held.topic.encode() in request:
                if held.holding:
                    held.requests.append(request)
                    continue
                if held.late:
                    held.deliver()
            kept.append(request)
        if kept:
            write(self, b"".join(kept))

    transport.KafkaTCPTransport.write = holding_write
    try:
        yield held
    finally:
        transport.KafkaTCPTransport.write = write


def _sink(bootstrap: str) -> KafkaSink:
    return KafkaSink(
        KafkaSinkConfig(
            bootstrap,
            linger_ms=0,
            delivery_timeout_ms=4000,
            request_timeout_ms=1500,
            max_block_ms=5000,
            transactional_id_prefix=f"outbox-late-{uuid.uuid4().hex[:6]}",
        )
    )


@pytest.mark.parametrize("leaves_the_session", [False, True], ids=["same-session", "left"])
def test_a_late_request_of_an_aborted_transaction_is_committed_only_in_its_own_session(
    kafka_bootstrap: str, held_back: HeldBack, leaves_the_session: bool
) -> None:
    message_id = uuid.uuid4()
    record = OutgoingRecord(
        message_id, held_back.topic, 0, b"k", b"v", [("outbox-id", str(message_id).encode())]
    )
    sink = _sink(kafka_bootstrap)
    try:
        sink.partition_count(held_back.topic)
        sink.begin_transaction()
        aborted_in = sink.transactional_id
        held_back.holding = True
        [report] = sink.complete(sink.send([record]))
        held_back.holding = False
        assert held_back.requests, "the produce request was not held back"
        assert may_land_after_abort(report.error, handed_to_producer=report.handed_to_producer)
        assert sink.end_transaction(commit=False) is TransactionEnd.ABORTED
        if leaves_the_session:
            sink.discard_producer()  # as the publisher does

        # Sent again in the next transaction, which adds its partition first;
        # the held-back request arrives just before the record does.
        sink.begin_transaction()
        assert (sink.transactional_id == aborted_in) is not leaves_the_session
        held_back.late = True
        [report] = sink.complete(sink.send([record]))
        assert not held_back.late, "the held-back request was not delivered"
        assert report.error is None, report.error
        assert sink.end_transaction(commit=True) is TransactionEnd.COMMITTED
    finally:
        sink.close()

    committed = read_topic(kafka_bootstrap, held_back.topic, committed=True)
    copies = sum(1 for r in committed if r.outbox_id == message_id)
    assert copies == (1 if leaves_the_session else 2)


def test_closing_with_a_request_unanswered_stops_the_producer(
    kafka_bootstrap: str, held_back: HeldBack
) -> None:
    """kafka-python's close raises when its flush times out, before it closes anything: the
    sink then drops what is unanswered, as a discarded producer does, and its sender stops."""
    message_id = uuid.uuid4()
    record = OutgoingRecord(message_id, held_back.topic, 0, b"k", b"v", [])
    sink = KafkaSink(
        KafkaSinkConfig(kafka_bootstrap, linger_ms=0, request_timeout_ms=1500, max_block_ms=5000)
    )
    sink.partition_count(held_back.topic)
    sender = sink._producer._sender
    held_back.holding = True
    sink.send([record])
    wait_until(lambda: held_back.requests, timeout=10, what="the produce request held back")

    sink.close()

    assert not sender.is_alive()
    assert sink.transactional_id is None

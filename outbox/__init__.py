"""Transactional outbox for PostgreSQL and Apache Kafka.

Write a publication intent in the caller's own database transaction: it
exists only if that transaction commits, and a publisher process then
delivers it to Kafka and records the broker's confirmation::

    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO orders ...")
        outbox.enqueue(conn, "orders", {"id": 42}, key="customer-7")
    # committed: the order row and its intent together, or neither

On an async connection, ``await outbox.aio.enqueue(conn, ...)`` does the same.
"""

from outbox import aio
from outbox.enqueue import Message, Outbox, enqueue, enqueue_many
from outbox.errors import (
    ConnectionInUse,
    ConnectionNotSupported,
    HeadersTooLarge,
    IdempotencyKeyRace,
    InvalidHeaders,
    InvalidIdempotencyKey,
    InvalidKey,
    InvalidMessage,
    InvalidTopic,
    InvalidValue,
    KeyTooLarge,
    MigrationError,
    NoOpenTransaction,
    OutboxError,
    TransactionAborted,
    ValueTooLarge,
)
from outbox.intent import ID_HEADER
from outbox.states import State

__version__ = "0.1.0"

__all__ = [
    "ID_HEADER",
    "ConnectionInUse",
    "ConnectionNotSupported",
    "HeadersTooLarge",
    "IdempotencyKeyRace",
    "InvalidHeaders",
    "InvalidIdempotencyKey",
    "InvalidKey",
    "InvalidMessage",
    "InvalidTopic",
    "InvalidValue",
    "KeyTooLarge",
    "Message",
    "MigrationError",
    "NoOpenTransaction",
    "Outbox",
    "OutboxError",
    "State",
    "TransactionAborted",
    "ValueTooLarge",
    "__version__",
    "aio",
    "enqueue",
    "enqueue_many",
]

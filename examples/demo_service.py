"""A small order service that publishes ``OrderPlaced`` through the outbox.

Run without arguments, it handles two requests:

* "place order" inserts an order row and enqueues its ``OrderPlaced`` event
  in one transaction, which commits: both exist, or neither would;
* a second request inserts an order and enqueues its event, then fails its
  own validation and rolls back: no order row, and no event, ever.

With ``--read`` it prints the records a Kafka consumer reads back from the
topic. Settings come from ``OUTBOX_DATABASE_URL`` and ``OUTBOX_KAFKA_BOOTSTRAP``.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox

TOPIC = "demo.orders"


class Base(DeclarativeBase):
    """The demo service's own tables."""


class Order(Base):
    """An order, the service's own state."""

    __tablename__ = "demo_orders"
    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    customer: Mapped[str]
    total: Mapped[Decimal]
    placed_at: Mapped[datetime]


class RejectedOrder(Exception):
    """The request failed validation after it had started writing."""


def place_order(session: Session, customer: str, total: Decimal) -> uuid.UUID:
    """Insert an order and enqueue OrderPlaced in the caller's transaction."""
    order = Order(id=uuid.uuid4(), customer=customer, total=total, placed_at=datetime.now(UTC))
    session.add(order)
    session.flush()
    event = {
        "type": "OrderPlaced",
        "order_id": str(order.id),
        "customer": customer,
        "total": str(total),
    }
    # Same transaction as the order row; the key keeps a customer's events in order.
    outbox.enqueue(
        session,
        TOPIC,
        event,
        key=customer,
        headers={"event-type": "OrderPlaced"},
        idempotency_key=f"order:{order.id}",
    )
    if total <= 0:
        raise RejectedOrder(f"order total must be positive, got {total}")
    return order.id


def handle_requests(database_url: str) -> None:
    """Serve one good and one rejected request."""
    engine = sa.create_engine(database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        order_id = place_order(session, "customer-7", Decimal("42.50"))
    print(f"placed order {order_id}: order row and OrderPlaced intent committed together")
    try:
        with Session(engine) as session, session.begin():
            place_order(session, "customer-9", Decimal("0"))
    except RejectedOrder as exc:
        print(f"rejected order rolled back ({exc}): no row, no intent")
    with engine.connect() as conn:
        orders = conn.execute(sa.text("SELECT count(*) FROM demo_orders")).scalar_one()
    print(f"demo_orders now holds {orders} order(s)")
    engine.dispose()


def read_back(bootstrap: str) -> None:
    """Print every record of the demo topic, as a consumer reads it."""
    # Imported here: the models above are the Alembic example's too
    # (examples/migrations), which needs only the library and SQLAlchemy.
    from kafka import KafkaConsumer, TopicPartition  # noqa: PLC0415

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        consumer_timeout_ms=5000,
    )
    partitions = consumer.partitions_for_topic(TOPIC) or set()
    tps = [TopicPartition(TOPIC, p) for p in sorted(partitions)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    end = consumer.end_offsets(tps)
    print(f"records in Kafka topic {TOPIC}:")
    for record in consumer:
        headers = {k: v.decode() for k, v in record.headers}
        print(
            f"  partition {record.partition} offset {record.offset} key {record.key!r} "
            f"outbox-id {headers.get(outbox.ID_HEADER)}"
        )
        print(f"    {json.loads(record.value)}")
        if all(consumer.position(tp) >= end[tp] for tp in tps):
            break
    consumer.close()


def main() -> None:
    """Handle the demo requests, or read the topic back with --read."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read", action="store_true", help="print the topic's records")
    args = parser.parse_args()
    if args.read:
        read_back(os.environ["OUTBOX_KAFKA_BOOTSTRAP"])
    else:
        handle_requests(os.environ["OUTBOX_DATABASE_URL"])


if __name__ == "__main__":
    main()

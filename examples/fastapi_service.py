"""An async order service: FastAPI, a SQLAlchemy ``AsyncSession`` and ``outbox.aio``.

``POST /orders`` inserts an order and enqueues its ``OrderPlaced`` event in
one transaction: both commit, or neither does. A customer's order reference
is unique; a repeated one is refused by the database when the transaction
commits, after the event was enqueued, so the request answers 409 and its
event is rolled back with the order.

Serve it with ``uvicorn --app-dir examples --factory fastapi_service:create_app``;
it reads ``OUTBOX_DATABASE_URL`` (the outbox tables must exist: ``outbox migrate``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal

import sqlalchemy as sa
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import outbox.aio

TOPIC = "shop.orders"


class Base(DeclarativeBase):
    """The service's own tables."""


class Order(Base):
    """An order; ``reference`` is the customer's, unique per customer."""

    __tablename__ = "shop_orders"
    __table_args__ = (sa.UniqueConstraint("customer", "reference"),)
    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    customer: Mapped[str]
    reference: Mapped[str]
    total: Mapped[Decimal]


class NewOrder(BaseModel):
    """The body of ``POST /orders``."""

    customer: str
    reference: str
    total: Decimal = Field(gt=0)


def create_app(database_url: str | None = None, topic: str = TOPIC) -> FastAPI:
    """The application, on ``database_url`` (default: ``OUTBOX_DATABASE_URL``)."""
    url = database_url or os.environ["OUTBOX_DATABASE_URL"]
    # outbox needs psycopg 3, the async driver too: postgresql+psycopg://
    engine = create_async_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    sessions = async_sessionmaker(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        yield
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def place_order(new: NewOrder) -> dict[str, str]:
        order_id = uuid.uuid4()
        event = {"type": "OrderPlaced", "order_id": str(order_id), "total": str(new.total)}
        try:
            async with sessions.begin() as session:  # commits on success, rolls back on error
                session.add(Order(id=order_id, **new.model_dump()))
                # Same transaction as the order; the key keeps a customer's events in order.
                await outbox.aio.enqueue(session, topic, event, key=new.customer)
        except sa.exc.IntegrityError:  # raised as the order is flushed, at commit
            raise HTTPException(409, f"order {new.reference!r} already exists") from None
        return {"order_id": str(order_id)}

    return app

"""Message ids: UUIDv7 (RFC 9562), so ids created later sort later.

Time-ordered ids keep inserts at the right edge of the primary key index
instead of scattering them over it, as random UUIDv4 would.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import UTC, datetime

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def _after_fork() -> None:
    """A forked child gets a fresh lock: another thread may have held the parent's at the
    fork, and no thread of the child would ever release it."""
    global _lock  # noqa: PLW0603 - replaced, not shared, in the child
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def new_message_id() -> uuid.UUID:
    """Return a new UUIDv7; ids from one process are strictly increasing."""
    global _last_ms, _counter  # noqa: PLW0603 - one monotonic clock per process
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            # Start the 12-bit counter at a random point in its lower half so
            # that two processes in the same millisecond rarely collide and the
            # counter still has room to grow.
            _counter = int.from_bytes(os.urandom(2), "big") & 0x7FF
        else:
            _counter += 1
            if _counter > 0xFFF:  # counter exhausted: borrow the next millisecond
                _last_ms += 1
                _counter = 0
        ms, counter = _last_ms, _counter
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand
    return uuid.UUID(int=value)


def created_at(message_id: uuid.UUID) -> datetime | None:
    """When a message id was made, by its writer's clock; None for a UUID not of version 7."""
    if message_id.version != 7:
        return None
    return datetime.fromtimestamp((message_id.int >> 80) / 1000, tz=UTC)

"""Opening the publisher's database connections: every one runs at READ COMMITTED.

The claim, mark, settle and recovery statements rely on READ COMMITTED, and
a database may default to another level (``default_transaction_isolation``
set for the server, the database or the role):

* a claim, settle, heartbeat or recovery statement that meets a row another
  transaction changed and committed after the statement began re-checks that
  row's new version and goes on; under REPEATABLE READ or SERIALIZABLE it
  fails with a serialization error instead, so publishers racing each other
  or recovery would fail where they should skip or change nothing;
* ``mark_sending`` reads the batch's messages in a second statement that
  must see what a recovery holding the batch row committed meanwhile: only
  READ COMMITTED gives each statement a fresh snapshot.

So every connection the publisher opens comes from ``connect`` here, which
pins the level for the whole session, transactions begun or implicit alike;
and its search_path to pg_catalog (``pin_search_path``): a function another
role planted in a schema on the default path (public) never runs as the
publisher.

Each also notices a database that went silent (a failover that leaves the
old address unanswered) within about a minute, rather than the kernel's two
hours: TCP keepalives, and a limit on how long sent data may stay
unacknowledged (``DEAD_PEER``), unless the URL sets its own. Without them a
settle waiting for its answer, or the heartbeat, would hang that long, with
its lease running out meanwhile.

An error opening one repeats nothing secret of the URL (see
``outbox.redaction``): libpq's parse errors quote pieces of it, and the
publisher logs every connection error it retries.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox.queries import query
from outbox.redaction import connect_errors_redacted

#: libpq settings every publisher connection gets, unless its URL (or the
#: caller) sets them: a silent peer is noticed within about a minute.
DEAD_PEER: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,  # milliseconds
    "connect_timeout": 10,
}


#: The longest idle_in_transaction_session_timeout PostgreSQL takes, in milliseconds.
_LONGEST_IDLE_TRANSACTION_MS = 2_147_483_647


def limit_idle_transactions(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Have the server end ``conn``'s session once a transaction of it stays idle
    ``seconds`` (``idle_transaction_limit``), for the rest of the session."""
    ms = min(max(1, round(seconds * 1000)), _LONGEST_IDLE_TRANSACTION_MS)
    conn.execute(query("idle_transaction_limit"), {"limit": str(ms)})
    if not conn.autocommit:
        conn.commit()


def connect(conninfo: str, *, autocommit: bool = False, **kwargs: Any) -> psycopg.Connection[Any]:
    """Open a connection (``kwargs`` as ``psycopg.connect``) pinned to READ COMMITTED.

    The level is set in autocommit mode, before the connection is handed out
    in the mode asked for: set inside a transaction, it would be undone if
    that transaction were rolled back.
    """
    with connect_errors_redacted(conninfo):
        given = conninfo_to_dict(conninfo)
        defaults = {k: v for k, v in DEAD_PEER.items() if k not in given}
        conn = psycopg.connect(conninfo, autocommit=True, **{**defaults, **kwargs})
    try:
        conn.execute(query("pin_read_committed"))
        conn.execute(query("pin_search_path"), (False,))
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn

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
pins the level for the whole session, transactions begun or implicit alike.

An error opening one repeats nothing secret of the URL (see
``outbox.redaction``): libpq's parse errors quote pieces of it, and the
publisher logs every connection error it retries.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.queries import query
from outbox.redaction import connect_errors_redacted


def connect(conninfo: str, *, autocommit: bool = False, **kwargs: Any) -> psycopg.Connection[Any]:
    """Open a connection (``kwargs`` as ``psycopg.connect``) pinned to READ COMMITTED.

    The level is set in autocommit mode, before the connection is handed out
    in the mode asked for: set inside a transaction, it would be undone if
    that transaction were rolled back.
    """
    with connect_errors_redacted(conninfo):
        conn = psycopg.connect(conninfo, autocommit=True, **kwargs)
    try:
        conn.execute(query("pin_read_committed"))
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn

"""Exceptions raised by the outbox library.

Every error raised for bad input is raised *before* anything is written, so
the caller's transaction is still usable and nothing is half-written.
"""

from __future__ import annotations

import re


class OutboxError(Exception):
    """Base class of every error the outbox library raises on purpose."""


class InvalidMessage(OutboxError, ValueError):
    """An argument of ``enqueue`` cannot become a Kafka record."""


class InvalidTopic(InvalidMessage):
    """The topic name is empty, too long, or has characters Kafka refuses (NUL included)."""


class InvalidKey(InvalidMessage):
    """The key is neither bytes nor str, or is a str UTF-8 cannot encode (a lone surrogate)."""


class KeyTooLarge(InvalidKey):
    """The encoded key is larger than the configured maximum (16,384 bytes by default)."""


class InvalidValue(InvalidMessage):
    """The value is neither bytes, str nor JSON-serialisable, nests too deeply for JSON, or
    is text UTF-8 cannot encode."""


class InvalidHeaders(InvalidMessage):
    """Headers are not a mapping or list of str names to bytes/str values, or a name has a
    NUL character, or a name or value is text UTF-8 cannot encode."""


class HeadersTooLarge(InvalidHeaders):
    """Headers take more than the configured maximum (16,384 bytes by default) in a Kafka
    record: their names and values in UTF-8, each after its length (a varint: 1 to 3 bytes
    for a name or value under 1 MiB)."""


class ValueTooLarge(InvalidValue):
    """The encoded value is larger than the configured maximum (1,000,000 bytes by
    default)."""


class InvalidIdempotencyKey(InvalidMessage):
    """The idempotency key is not a non-empty str, has a NUL character or a lone
    surrogate, or is longer than 1,024 bytes in UTF-8 (it is kept in a unique index)."""


class IdempotencyKeyRace(OutboxError):
    """The idempotency key was taken by a message that was deleted (purged by retention)
    before the key could be looked up. Nothing of the call was written: retrying the
    enqueue writes it anew."""


class ConnectionNotSupported(OutboxError, TypeError):
    """``conn`` is not a SQLAlchemy Session/Connection or a psycopg 3 Connection."""


class ConnectionInUse(OutboxError):
    """Another enqueue runs on this connection now (another task or thread): the two would
    share its transaction and savepoints, and one's rollback to its savepoint could undo
    the other's rows after it returned their ids."""


class NoOpenTransaction(OutboxError):
    """The connection would commit the intent on its own (autocommit, no transaction)."""


class TransactionAborted(OutboxError):
    """The caller's transaction has already failed; it must be rolled back first."""


class MigrationError(OutboxError):
    """The schema migrations are missing, malformed or newer than this library."""


def said(error: BaseException) -> str:
    """What ``error`` says, for a command's stderr: without the excerpt of the statement
    that libpq adds to a database error ("LINE 7: GRANT ...", then a caret line); its
    DETAIL and HINT lines stay."""
    return _STATEMENT_EXCERPT.sub("", str(error)).strip()


#: libpq's excerpt of the statement an error points into: the line, and a caret under it.
_STATEMENT_EXCERPT = re.compile(r"\nLINE \d+: [^\n]*(?:\n[ \t]*\^[ \t]*(?=\n|$))?")

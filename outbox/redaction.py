"""Keeping credentials out of what the outbox prints: logs, error messages, CLI output.

A database URL may carry a password in every form libpq accepts, and each
one is hidden here:

* URL user info, ``postgresql://user:pw@host/db``, percent-encoded or not:
  everything after ``user:`` up to the last ``@`` before the query's first
  parameter, or else the last ``@`` of the URL, so that a password typed
  unencoded (an ``@``, ``/``, ``?`` or ``#`` in it) is hidden whole, however
  libpq would cut it;
* the ``password`` and ``sslpassword`` query parameters of a URL, their
  names percent-encoded or not (``?password=pw``, ``?pass%77ord=pw``);
* ``password=`` and ``sslpassword=`` in a key/value connection string,
  quoted or not (``host=h password='p w'``), and ``PGPASSWORD=`` written out.

``redact`` rewrites a connection string, or a text holding some, by these
rules. ``scrub`` also removes from a text every string that may be a
password of one connection string (and of ``PGPASSWORD``): libpq's own
messages can repeat a piece of a URL that does not parse (a host name made of
the end of a password), and only the URL says what to look for.

Opening a connection goes through ``connect_errors_redacted``: psycopg's
parse errors, which repeat pieces of the URL, become "the database URL could
not be parsed: <reason>" with the quoted pieces left out, and any other
connection error is scrubbed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from types import MappingProxyType
from typing import NoReturn
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict

#: What a secret is replaced with.
REDACTED = "***"
#: libpq settings that hold a secret (a URL query parameter or a key/value pair).
SECRET_KEYS = frozenset({"password", "sslpassword"})
#: Environment variables libpq reads a secret from.
SECRET_ENV = ("PGPASSWORD", "PGSSLPASSWORD")
#: Pieces of a password shorter than this are not searched for in a message:
#: they would blank ordinary words, and say little about the password.
MIN_SCRUBBED = 3

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: A URL inside a text runs to the next blank or quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]*")
#: ``password = value`` (and sslpassword, PGPASSWORD): a value quoted libpq's
#: way ('...' with backslash escapes; unterminated: to the end) or a bare run.
_KEY_VALUE = re.compile(r"(?i)\b((?:pg)?(?:ssl)?password)(\s*=\s*)('(?:[^'\\]|\\.)*'?|(?:\\.|\S)*)")
#: Where libpq may cut a malformed URL into pieces (hosts, ports, user names).
_PIECES = re.compile(r"[@/:?#&,=\s\[\]'\"]+")
_QUOTED = re.compile(r'"([^"]*)"')
#: Where a URL's query starts: a '?' then a parameter name and '='.
_QUERY_START = re.compile(r"\?[^=&@/#?]*=")


def _redact_url(url: str) -> str:
    """A URL with its secret query parameters and its user info's password hidden."""
    head = _SCHEME.match(url)
    if head is None:
        return url
    scheme, rest = url[: head.end()], url[head.end() :]
    # The query first: a password there may hold an '@', which would read as
    # the end of user info below.
    query_at = rest.find("?")
    if query_at >= 0:
        pairs = []
        for pair in rest[query_at + 1 :].split("&"):
            key, eq, _ = pair.partition("=")
            secret = eq and unquote(key).strip().lower() in SECRET_KEYS
            pairs.append(key + eq + REDACTED if secret else pair)
        rest = rest[: query_at + 1] + "&".join(pairs)
    at = _user_info_end(rest)
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        if colon:
            rest = user + ":" + REDACTED + rest[at:]
    return scheme + rest


def _user_info_end(rest: str) -> int:
    """Where the user info of a URL (after ``scheme://``) ends: its last '@' before the
    query's first ``key=``, else its last '@'; -1 if it has none.

    An '@' after the first is in a password typed unencoded (with a '/', '?'
    or '#' before it too, libpq cuts the URL elsewhere, and the pieces would
    show), or in a query value (``?application_name=svc@pod``), or, rarely,
    in a database name, hidden with the password: more hidden, never less.
    """
    query = _QUERY_START.search(rest)
    at = rest.rfind("@", 0, query.start()) if query else -1
    return at if at >= 0 else rest.rfind("@")


def _redact_key_values(text: str) -> str:
    return _KEY_VALUE.sub(lambda m: m[1] + m[2] + REDACTED, text)


def redact(text: str) -> str:
    """``text`` (a connection string, or a message holding some) with every password hidden.

    A text that is one URL is read as one, blanks and all; in any other text,
    each URL runs to the next blank or quote, and key/value pairs are
    redacted around them.
    """
    stripped = text.strip()
    if _SCHEME.match(stripped):
        start = text.index(stripped)
        return text[:start] + _redact_url(stripped) + text[start + len(stripped) :]
    out, last = [], 0
    for match in _URL_IN_TEXT.finditer(text):
        out.append(_redact_key_values(text[last : match.start()]))
        out.append(_redact_url(match[0]))
        last = match.end()
    out.append(_redact_key_values(text[last:]))
    return "".join(out)


def _unquote_key_value(value: str) -> str:
    if value.startswith("'"):
        value = value[1:-1] if value.endswith("'") and len(value) > 1 else value[1:]
    return re.sub(r"\\(.)", r"\1", value)


def secrets_in(conninfo: str) -> set[str]:
    """Every string that may be a password of ``conninfo``, however it is read.

    The password as libpq reads it, and as each rule of ``redact`` finds it
    (raw and percent-decoded), for URLs that do not parse too.
    """
    found: set[str] = set()
    stripped = conninfo.strip()
    head = _SCHEME.match(stripped)
    if head:
        rest = stripped[head.end() :]
        for at in {rest.find("@"), rest.rfind("@")} - {-1}:
            userinfo = rest[:at]
            if ":" in userinfo:
                found.add(userinfo.partition(":")[2])
        query = rest.partition("?")[2]
        for pair in query.split("&"):
            key, eq, value = pair.partition("=")
            if eq and unquote(key).strip().lower() in SECRET_KEYS:
                found.add(value)
    else:
        for match in _KEY_VALUE.finditer(stripped):
            found.add(_unquote_key_value(match[3]))
    try:
        parsed = conninfo_to_dict(conninfo)
    except psycopg.Error:
        parsed = {}
    found.update(str(parsed[k]) for k in SECRET_KEYS if parsed.get(k))
    found.update(os.environ[name] for name in SECRET_ENV if os.environ.get(name))
    found |= {unquote(s) for s in found}
    return {s for s in found if s}


def scrub(text: str, conninfo: str) -> str:
    """``redact(text)``, and every password of ``conninfo`` (or piece of one) hidden in it.

    A piece is what a malformed URL may be cut into where libpq splits one
    (``@ / : ? # & , =``, blanks, brackets); pieces shorter than
    ``MIN_SCRUBBED`` characters, and the names of libpq settings, are left.
    """
    text = redact(text)
    secrets = secrets_in(conninfo)
    for secret in list(secrets):
        secrets.update(_PIECES.split(secret))
    # A piece that is a setting's name (a malformed URL cut at its query) is no secret.
    secrets -= _libpq_keywords() | SECRET_KEYS
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= MIN_SCRUBBED:
            text = text.replace(secret, REDACTED)
    return text


@cache
def _libpq_keywords() -> frozenset[str]:
    return (
        frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())
        - SECRET_KEYS
    )


def parse_reason(message: str) -> str:
    """libpq's reason for refusing a connection string, without the pieces of it it quotes.

    libpq quotes the offending piece (``invalid percent-encoded token:
    "p%zz"``, or the whole URL): a quoted piece stays only when it names a
    libpq setting or is one punctuation mark.
    """

    def keep(match: re.Match[str]) -> str:
        piece = match[1]
        shown = piece in _libpq_keywords() or (len(piece) == 1 and not piece.isalnum())
        return match[0] if shown else '"..."'

    return redact(_QUOTED.sub(keep, message.strip()))


class DatabaseURLError(psycopg.ProgrammingError):
    """The database URL could not be parsed (the message repeats nothing of it)."""


def redacted_error(exc: psycopg.Error, conninfo: str) -> psycopg.Error:
    """An error raised while opening ``conninfo``, made safe to print; ``exc`` if it was.

    A ``ProgrammingError`` there is libpq refusing the connection string;
    any other error is scrubbed of the URL's secrets, and kept as it is
    (its class and diagnostics) when there was nothing to scrub.
    """
    if isinstance(exc, DatabaseURLError):
        return exc
    if isinstance(exc, psycopg.ProgrammingError) and exc.sqlstate is None:
        return DatabaseURLError(f"the database URL could not be parsed: {parse_reason(str(exc))}")
    shown = scrub(str(exc), conninfo)
    return exc if shown == str(exc) else type(exc)(shown)


@contextmanager
def connect_errors_redacted(conninfo: str) -> Iterator[None]:
    """Around opening a connection to ``conninfo``: the errors raised leak none of its secrets.

    The original error is not chained (``from None``), so a traceback in a
    log does not print it either.
    """
    try:
        yield
    except psycopg.Error as exc:
        safe = redacted_error(exc, conninfo)
        if safe is exc:
            raise
        raise safe from None


def check_conninfo(conninfo: str) -> None:
    """Raise ``DatabaseURLError`` when libpq cannot parse ``conninfo``, or would refuse one
    of its settings, before connecting."""
    problem = driver_url_problem(conninfo)
    if problem:
        raise DatabaseURLError(problem)
    scheme, sep, _ = conninfo.strip().partition("://")
    if sep and scheme not in ("postgresql", "postgres") and "=" not in scheme:
        # libpq would read it as key=value settings: 'missing "=" after ...'.
        raise DatabaseURLError(
            f"the database URL starts with {scheme[:20]}://; libpq takes a postgresql:// "
            "URL (or key=value settings)"
        )
    with connect_errors_redacted(conninfo):
        parts = conninfo_to_dict(conninfo)
    problem = libpq_choice_problem(parts)
    if problem:
        raise DatabaseURLError(f"the database URL {problem}")


#: libpq's settings that take one word of a fixed set, and the words, compared
#: exactly as libpq (18) does. libpq checks them only when it connects, and a
#: connection refused there cannot be told from an unreachable server (psycopg
#: gives neither a SQLSTATE): a publisher would retry a typo for ever.
LIBPQ_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "load_balance_hosts": ("disable", "random"),
    "sslcertmode": ("disable", "allow", "require"),
    "sslnegotiation": ("postgres", "direct"),
}


def libpq_choice_problem(parts: Mapping[str, object]) -> str | None:
    """What libpq would refuse in ``parts`` (a parsed connection string) at connecting:
    a setting of ``LIBPQ_CHOICES`` given a word it does not take, or a
    ``connect_timeout`` that is not a number; ``None`` if none.

    The words are not secrets: the value is quoted, with the words libpq takes.
    """
    for name, words in LIBPQ_CHOICES.items():
        value = parts.get(name)
        if value is not None and value not in words:
            return f"sets {name}={str(value)!r} (libpq takes {', '.join(words)})"
    timeout = parts.get("connect_timeout")
    if timeout is not None:
        # psycopg reads it before connecting, as a number of seconds.
        try:
            finite = math.isfinite(float(str(timeout)))
        except ValueError:
            finite = False
        if not finite:
            return f"sets connect_timeout={str(timeout)!r} (a number of seconds)"
    return None


def driver_url_problem(url: str) -> str | None:
    """What is wrong with a SQLAlchemy URL (``postgresql+psycopg://``) given where libpq's
    is expected, or ``None``; libpq itself only says that it does not parse."""
    scheme, sep, _ = url.strip().partition("://")
    if not sep or "+" not in scheme or scheme.partition("+")[0] not in ("postgresql", "postgres"):
        return None
    return (
        f"the database URL starts with {scheme}://, which names a SQLAlchemy driver; "
        "libpq takes postgresql:// (the same URL without +" + scheme.partition("+")[2] + ")"
    )


class SecretSafeArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors never repeat a secret the user typed.

    argparse echoes unrecognized arguments ("unrecognized arguments:
    --kafka-sasl-password s3cret"): a secret typed after a mistyped or
    non-existent flag would reach the terminal and the logs. Here only the
    option names of such arguments are shown; every other word is ``...``.
    It also quotes a value it refuses ("invalid choice:
    'postgresql://app:s3cret@db/app'", a URL typed where a command or an id
    was expected): passwords in such values are hidden, as ``redact`` does.
    """

    #: Words shown as typed among unrecognized arguments (command names, never secrets),
    #: each with what to say when it is there.
    known_words: Mapping[str, str] = MappingProxyType({})

    def error(self, message: str) -> NoReturn:
        """Print the usage and the message, values of unrecognized arguments left out and
        passwords hidden."""
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            words = message[len(prefix) :].split()
            shown = [
                w.split("=", 1)[0] if w.startswith("-") else w if w in self.known_words else "..."
                for w in words
            ]
            message = prefix + " ".join(shown)
            hints = [self.known_words[w] for w in dict.fromkeys(words) if w in self.known_words]
            if hints:
                message += f" ({'; '.join(hints)})"
        super().error(redact(message))

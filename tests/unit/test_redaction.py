"""outbox.redaction: every credential form libpq accepts is hidden, and parse errors too."""

from __future__ import annotations

import re
import uuid
from urllib.parse import quote

import psycopg
import pytest

from outbox.errors import said
from outbox.redaction import (
    LIBPQ_CHOICES,
    REDACTED,
    DatabaseURLError,
    SecretSafeArgumentParser,
    check_conninfo,
    parse_reason,
    redact,
    redacted_error,
    scrub,
    secrets_in,
)
from publisher.config import ConfigError, resolve
from publisher.connector import connect

SECRET = "Sup3r-Secret"  # noqa: S105 - a made-up password the tests look for
#: A password with every character that needs percent-encoding in a URL.
ODD = "p@ss w/rd?#&=Sup3r"

#: (connection string, what must not show) for every form libpq accepts.
FORMS = [
    (f"postgresql://alice:{SECRET}@db.example:5432/app", [SECRET]),
    (f"postgres://alice:{SECRET}@db.example/app?sslmode=require", [SECRET]),
    (f"postgresql://alice:{quote(ODD, safe='')}@db.example/app", [quote(ODD, safe=""), ODD]),
    (f"postgresql://db.example/app?user=alice&password={SECRET}", [SECRET]),
    (f"postgresql://db.example/app?pass%77ord={SECRET}&sslmode=require", [SECRET]),
    (f"postgresql://db.example/app?sslpassword={SECRET}", [SECRET]),
    (f"postgresql://db1:5432,db2:5433/app?password={SECRET}", [SECRET]),
    (f"host=db.example user=alice password={SECRET} dbname=app", [SECRET]),
    (f"host=db.example password = '{SECRET} with spaces' dbname=app", [SECRET, "with spaces"]),
    ("host=db.example password='it\\'s Sup3r-Secret' dbname=app", [SECRET, "it\\'s"]),
    (f"host=db.example password={SECRET}\\ more dbname=app", [SECRET, "more"]),
    (f"host=db.example sslpassword={SECRET}", [SECRET]),
    # URLs that do not parse: a raw '@', '/', '?' or blank in the password.
    (f"postgresql://alice:{SECRET}@x@db.example/app", [SECRET, f"{SECRET}@x"]),
    (f"postgresql://alice:{SECRET}/x@db.example/app", [SECRET]),
    (f"postgresql://alice:{SECRET}?x@db.example/app", [SECRET]),
    (f"postgresql://alice:{SECRET} x@db.example/app", [SECRET]),
    # An '@' first, then a '/', '?' or '#', then the real '@': each piece hidden.
    (f"postgresql://alice:a1@{SECRET}/more-{SECRET}@db.example/app", [SECRET, "a1@"]),
    (f"postgresql://alice:a1@{SECRET}?more-{SECRET}@db.example/app", [SECRET]),
    (f"postgresql://alice:a1@{SECRET}#more-{SECRET}@db.example/app", [SECRET]),
    (f"postgresql://db.example/app?password={SECRET}@x", [SECRET]),
    (f"PGPASSWORD={SECRET} outbox status", [SECRET]),
]


@pytest.mark.parametrize(("conninfo", "hidden"), FORMS)
def test_redact_hides_the_password_in_every_form(conninfo: str, hidden: list[str]) -> None:
    """Whatever the form, no piece of the password is left and the marker shows where it was."""
    shown = redact(conninfo)
    for secret in hidden:
        assert secret not in shown, shown
    assert REDACTED in shown


@pytest.mark.parametrize(("conninfo", "hidden"), FORMS)
def test_redact_hides_them_inside_a_message(conninfo: str, hidden: list[str]) -> None:
    """A URL or key/value string quoted in a longer text is redacted there too."""
    if conninfo.startswith("postgres") and " " in conninfo.split("@", maxsplit=1)[0]:
        pytest.skip("a URL with a blank in its password is only whole when given alone")
    shown = redact(f"could not connect to {conninfo}: refused")
    for secret in hidden:
        assert secret not in shown, shown


def test_redact_leaves_what_is_no_secret() -> None:
    """User, host, port, database and other parameters stay readable."""
    url = f"postgresql://alice:{SECRET}@db.example:5432/app?sslmode=require&password=x"
    assert redact(url) == (
        f"postgresql://alice:{REDACTED}@db.example:5432/app?sslmode=require&password={REDACTED}"
    )
    assert redact("postgresql://alice@db.example/app") == "postgresql://alice@db.example/app"
    assert redact("host=h user=u dbname=d") == "host=h user=u dbname=d"
    assert redact("connection refused") == "connection refused"


def test_secrets_in_finds_the_password_however_it_is_read() -> None:
    """Raw and percent-decoded, and under each reading of a URL with several '@'."""
    assert {ODD, quote(ODD, safe="")} <= secrets_in(
        f"postgresql://alice:{quote(ODD, safe='')}@db.example/app"
    )
    assert {"pa", f"pa@{SECRET}"} <= secrets_in(f"postgresql://u:pa@{SECRET}@h/db")
    assert secrets_in("host=h password='a b'") >= {"a b"}


def test_scrub_removes_the_pieces_libpq_repeats_from_a_malformed_url() -> None:
    """libpq cuts 'u:pa@Secret@h' at the first '@': the host it cannot resolve is a piece
    of the password, and scrub hides it."""
    url = f"postgresql://u:pa@{SECRET}@127.0.0.1/db"
    message = f"failed to resolve host '{SECRET}@127.0.0.1': Name or service not known"
    assert SECRET not in scrub(message, url)
    assert "Name or service not known" in scrub(message, url)


def test_scrub_hides_the_password_given_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PGPASSWORD is a password of every connection string."""
    monkeypatch.setenv("PGPASSWORD", SECRET)
    assert SECRET not in scrub(f"authentication failed ({SECRET})", "host=h")


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (f'invalid percent-encoded token: "{SECRET}%zz"\n', 'invalid percent-encoded token: "..."'),
        (
            f'missing "=" after "{SECRET}" in connection info string\n',
            'missing "=" after "..." in connection info string',
        ),
        (
            'invalid integer value "x" for connection option "port"',
            'invalid integer value "..." for connection option "port"',
        ),
        (
            f'end of string reached when looking for matching "]" in IPv6 host address in URI: '
            f'"postgresql://u:{SECRET}@[::1/db"',
            'end of string reached when looking for matching "]" in IPv6 host address in URI: '
            '"..."',
        ),
    ],
)
def test_parse_reason_keeps_the_reason_and_drops_the_quoted_pieces(
    message: str, reason: str
) -> None:
    """Setting names and single punctuation marks stay; anything else quoted goes."""
    assert parse_reason(message) == reason


UNPARSABLE = [
    f"postgresql://u:{SECRET}@[::1/db",
    f"postgresql://u:{SECRET}%zz@h/db",
    f"postgresql://u:{SECRET} x@h/db",
    f"host=h password=Secret-one {SECRET}",
    f"host=h password='{SECRET}",
    f"postgresql://h/db?password={SECRET}&{SECRET}",
]


@pytest.mark.parametrize("conninfo", UNPARSABLE)
def test_a_url_that_does_not_parse_says_so_without_repeating_it(conninfo: str) -> None:
    """check_conninfo raises DatabaseURLError, whose text has no piece of the password."""
    with pytest.raises(DatabaseURLError) as refused:
        check_conninfo(conninfo)
    assert str(refused.value).startswith("the database URL could not be parsed: ")
    assert SECRET not in str(refused.value)
    assert refused.value.__cause__ is None
    assert refused.value.__suppress_context__


@pytest.mark.parametrize("conninfo", UNPARSABLE)
def test_the_publisher_connector_refuses_it_the_same_way(conninfo: str) -> None:
    """publisher.connector.connect fails before connecting, with the same safe error."""
    with pytest.raises(DatabaseURLError) as refused:
        connect(conninfo)
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize("conninfo", UNPARSABLE[:3])
def test_the_publisher_config_names_the_problem_without_the_password(conninfo: str) -> None:
    """A database URL the publisher's configuration refuses is shown redacted, reason too."""
    with pytest.raises(ConfigError) as refused:
        resolve({"database_url": conninfo, "kafka_bootstrap": "k:9092"}, {}, None)
    assert SECRET not in str(refused.value)


def test_an_error_with_nothing_to_hide_is_kept_as_it_is() -> None:
    """redacted_error returns the original (class and diagnostics) when nothing needs hiding."""
    error = psycopg.OperationalError("connection refused")
    assert redacted_error(error, f"postgresql://u:{SECRET}@h/db") is error
    leaking = psycopg.OperationalError(f"failed to resolve host '{SECRET}@h'")
    safe = redacted_error(leaking, f"postgresql://u:pa@{SECRET}@h/db")
    assert type(safe) is psycopg.OperationalError
    assert SECRET not in str(safe)


@pytest.mark.parametrize(
    "argv",
    [
        ["postgresql://app:s3cret-pw@db/app", "status"],  # a URL where the command goes
        ["inspect", "postgresql://app:s3cret-pw@db/app"],  # a URL where the id goes
        ["inspect", "host=db password=s3cret-pw"],
    ],
    ids=["command", "id", "key-value"],
)
def test_a_refused_value_is_quoted_without_its_password(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse quotes a value it refuses; a database URL typed in the wrong place keeps
    its password to itself."""
    parser = SecretSafeArgumentParser(prog="outbox")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser("status")
    commands.add_parser("inspect").add_argument("id", type=uuid.UUID)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "s3cret-pw" not in err
    assert REDACTED in err


@pytest.mark.parametrize(
    "url", [f"postgresql+psycopg://u:{SECRET}@h/db", f"postgres+psycopg2://u:{SECRET}@h/db"]
)
def test_a_sqlalchemy_url_is_named_as_one_with_the_fix(url: str) -> None:
    """libpq only says such a URL does not parse (missing "="): the outbox commands, the
    recorder and the publisher's config say it names a driver, and what to drop."""
    driver = url.partition("://")[0].partition("+")[2]
    with pytest.raises(DatabaseURLError, match=rf"names a SQLAlchemy driver.* without \+{driver}"):
        check_conninfo(url)
    with pytest.raises(ConfigError, match=r"names a SQLAlchemy driver") as refused:
        resolve({"database_url": url, "kafka_bootstrap": "k:9092"}, {}, None)
    assert SECRET not in str(refused.value)


def test_a_database_error_is_said_without_the_statement_excerpt() -> None:
    """libpq adds the statement's line and a caret under it: a command's one line keeps the
    message alone (outbox and outbox-publisher print errors through ``said``)."""
    error = psycopg.errors.InsufficientPrivilege(
        "must be owner of table messages\nLINE 7: GRANT SELECT ON outbox.messages TO x\n"
        "               ^"
    )
    assert said(error) == "must be owner of table messages"
    assert said(ValueError("one\ntwo")) == "one\ntwo"
    hinted = psycopg.errors.UndefinedFunction(
        "function outbox.nofunc(integer) does not exist\nLINE 1: select outbox.nofunc(1)\n"
        "               ^\nHINT:  No function matches the given name and argument types."
    )
    assert said(hinted) == (
        "function outbox.nofunc(integer) does not exist\n"
        "HINT:  No function matches the given name and argument types."
    )


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://u:pw@host/db?application_name=svc@pod",
            "postgresql://u:***@host/db?application_name=svc@pod",
        ),
        (
            "postgresql://u:pw@host/db?sslrootcert=/etc/x@y/ca.pem",
            "postgresql://u:***@host/db?sslrootcert=/etc/x@y/ca.pem",
        ),
        ("postgresql://u:x?k=v@h/db", "postgresql://u:***@h/db"),
    ],
)
def test_an_at_sign_in_a_query_value_keeps_the_host_shown(url: str, shown: str) -> None:
    """The start-up line shows which database: an '@' in a query value does not end the
    user info (a password with a '?' and '=' in it is still hidden whole)."""
    assert redact(url) == shown


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("sslmode=bogus", "sslmode='bogus' (libpq takes disable, allow, prefer, require,"),
        ("sslmode=Require", "sslmode='Require'"),
        ("sslmode=", "sslmode=''"),
        ("target_session_attrs=primary-only", "target_session_attrs='primary-only'"),
        ("gssencmode=on", "gssencmode='on'"),
        ("channel_binding=yes", "channel_binding='yes'"),
        ("connect_timeout=abc", "connect_timeout='abc' (a number of seconds)"),
        ("connect_timeout=nan", "connect_timeout='nan' (a number of seconds)"),
        ("connect_timeout=inf", "connect_timeout='inf' (a number of seconds)"),
    ],
)
def test_a_setting_libpq_refuses_only_when_connecting_is_refused_before(
    query: str, named: str
) -> None:
    """libpq checks these words only when it connects, and psycopg's error then looks like
    an unreachable server's: the publisher retried a typo for ever. The outbox commands,
    the recorder and the publisher's config refuse it at once, naming the setting."""
    url = f"postgresql://u:{SECRET}@h/db?{query}"
    with pytest.raises(DatabaseURLError, match=re.escape(f"the database URL sets {named}")):
        check_conninfo(url)
    with pytest.raises(ConfigError, match=re.escape(named)) as refused:
        resolve({"database_url": url, "kafka_bootstrap": "k:9092"}, {}, None)
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize(
    "query",
    [f"{name}={word}" for name, words in LIBPQ_CHOICES.items() for word in words],
)
def test_the_table_takes_what_libpq_takes(query: str) -> None:
    """Each word of the table is one libpq takes, and a word out of it one libpq refuses
    (asked through a socket directory that does not exist: nothing is connected to)."""
    check_conninfo(f"postgresql://u@h/db?{query}")
    name = query.partition("=")[0]
    for setting, refused in ((query, False), (f"{name}=bogus", True)):
        conninfo = f"host=/nonexistent-outbox-socket-dir port=1 {setting}"
        pgconn = psycopg.pq.PGconn.connect_start(conninfo.encode())
        try:
            said_by_libpq = pgconn.error_message.decode()
        finally:
            pgconn.finish()
        assert (f"invalid {name} value" in said_by_libpq) is refused, said_by_libpq


def test_a_url_of_another_database_is_named_as_one() -> None:
    """libpq reads 'mysql://...' as key=value settings and says 'missing "="'."""
    with pytest.raises(DatabaseURLError, match=r"starts with mysql://; libpq takes a postgres"):
        check_conninfo(f"mysql://u:{SECRET}@h/db")

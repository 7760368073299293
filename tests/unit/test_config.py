"""Checking publisher settings (publisher/config.py): every problem on its own line."""

from __future__ import annotations

import importlib.util
from dataclasses import fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outbox.errors import OutboxError
from outbox.retention import DEFAULT_EVIDENCE_AGE, evidence_age_for
from publisher.cli import config_from_args
from publisher.config import SETTINGS, ConfigError, PublisherConfig, config_from_values
from publisher.reconcile_cli import config_from_args as reconcile_config
from tests.support import CA_PEM

VALID = PublisherConfig(database_url="postgresql://x", kafka_bootstrap="h:1")


def _problems(error: ConfigError) -> list[str]:
    """The problem lines of a ConfigError (its first line is the heading)."""
    heading, *lines = str(error).splitlines()
    assert heading == "invalid publisher configuration:"
    return [line.strip() for line in lines]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"database_url": "postgres://user:pw@db:5432/app"},
        {"kafka_bootstrap": "broker-1:9092, broker-2:9092,10.0.0.3:9093"},
        {"kafka_bootstrap": "[::1]:9092"},
        {"batch_size": 1, "poll_interval": 0.01},
        {"retry_base_seconds": 5.0, "retry_cap_seconds": 5.0},
        {"delivery_timeout_ms": 10_005, "linger_ms": 5, "request_timeout_ms": 10_000},
        {"lease_seconds": 40.001},
    ],
)
def test_valid_config_passes(overrides: dict[str, Any]) -> None:
    """A config with sound settings (edge values included) validates without error."""
    replace(VALID, **overrides).validate()


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"database_url": ""}, "database URL is missing"),
        ({"heartbeat_interval": 0}, "heartbeat interval (0s) must be positive"),
        ({"heartbeat_interval": 31}, "at most a third of the lease (60s)"),
        ({"heartbeat_interval": 20.5}, "at most a third of the lease (60s)"),
        ({"recovery_interval": 0}, "recovery interval must be positive"),
        ({"reconcile_interval": -1}, "reconcile interval must be 0 (off) or positive"),
        ({"database_url": "mysql://x"}, "database URL 'mysql://x' must start with postgresql://"),
        ({"kafka_bootstrap": ""}, "Kafka bootstrap servers are missing"),
        ({"kafka_bootstrap": "host"}, "Kafka bootstrap server 'host' is not host:port"),
        ({"kafka_bootstrap": "host:port"}, "'host:port' is not host:port"),
        ({"kafka_bootstrap": ":9092"}, "':9092' is not host:port"),
        ({"kafka_bootstrap": "h:1,h2"}, "'h2' is not host:port"),
        ({"batch_size": 0}, "batch size must be at least 1, got 0"),
        ({"poll_interval": 0}, "poll interval must be positive, got 0"),
        ({"poll_interval": -1.0}, "poll interval must be positive"),
        ({"retry_base_seconds": 10.0, "retry_cap_seconds": 5.0}, "0 < base <= cap"),
        ({"retry_base_seconds": 0.0}, "0 < base <= cap"),
        (
            {"delivery_timeout_ms": 5_000, "linger_ms": 5, "request_timeout_ms": 10_000},
            "delivery timeout must be at least linger + request timeout",
        ),
        ({"lease_seconds": 40.0}, "lease (40s) must be longer than the longest a send can take"),
        ({"lease_seconds": 10.0, "heartbeat_interval": 3.0}, "lease (10s) must be longer"),
        ({"transaction_records": 0}, "transaction records must be at least 1, got 0"),
        pytest.param(
            {"sink": "confluent", "delivery_timeout_ms": 1_500, "request_timeout_ms": 500},
            "must add up to more than 2100 ms",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("confluent_kafka") is None,
                reason="the confluent extra is not installed",
            ),
            id="confluent-timeouts",
        ),
    ],
)
def test_each_invalid_setting_is_reported_on_its_own_line(
    overrides: dict[str, Any], fragment: str
) -> None:
    """One bad setting gives a ConfigError with exactly one problem line, naming it."""
    with pytest.raises(ConfigError) as caught:
        replace(VALID, **overrides).validate()
    problems = _problems(caught.value)
    assert len(problems) == 1, problems
    assert fragment in problems[0]


def test_every_problem_is_listed_at_once() -> None:
    """Several bad settings are all listed, one line each, in a single ConfigError."""
    config = replace(
        VALID,
        database_url="",
        kafka_bootstrap="host",
        batch_size=0,
        poll_interval=0,
        retry_base_seconds=2.0,
        retry_cap_seconds=1.0,
        lease_seconds=1.0,
    )
    with pytest.raises(ConfigError) as caught:
        config.validate()
    problems = _problems(caught.value)
    assert len(problems) == 7, problems
    for fragment in (
        "heartbeat interval (5s) must be positive and at most a third of the lease (1s)",
        "database URL is missing",
        "'host' is not host:port",
        "batch size",
        "poll interval",
        "0 < base <= cap",
        "lease (1s) must be longer",
    ):
        assert sum(fragment in p for p in problems) == 1, fragment


def test_config_error_is_an_outbox_error() -> None:
    """ConfigError can be caught as outbox's base error."""
    with pytest.raises(OutboxError):
        replace(VALID, batch_size=0).validate()


def test_longest_send_is_delivery_plus_request_timeout() -> None:
    """The longest a send may take is delivery timeout plus request timeout, in seconds."""
    config = replace(VALID, delivery_timeout_ms=30_000, request_timeout_ms=10_000)
    assert config.longest_send_seconds == 40.0


def test_write_deadline_covers_the_hand_over_window_a_blocked_send_and_the_longest_send() -> None:
    """Records are handed over within max_block; one may block max_block; then the send."""
    config = replace(
        VALID, max_block_ms=5_000, delivery_timeout_ms=30_000, request_timeout_ms=10_000
    )
    assert config.hand_over_seconds == 5.0
    assert config.write_deadline_seconds == 5.0 + 5.0 + 40.0


# --- sources: flags, environment, config file, defaults ---------------------------

BASE_ENV = {"OUTBOX_DATABASE_URL": "postgresql://db/app", "OUTBOX_KAFKA_BOOTSTRAP": "k:9092"}


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "publisher.toml"
    path.write_text(text)
    return str(path)


def _refusal(argv: list[str], environ: dict[str, str]) -> list[str]:
    """The problem lines of the ConfigError that ``config_from_args`` raises."""
    with pytest.raises(ConfigError) as caught:
        config_from_args(argv, environ)
    return _problems(caught.value)


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(
    tmp_path: Path,
) -> None:
    """Each of four settings is taken from the strongest source that sets it."""
    path = _write(
        tmp_path,
        "batch_size = 11\nlinger_ms = 12\nmax_attempts = 13\n",
    )
    env = {**BASE_ENV, "OUTBOX_BATCH_SIZE": "21", "OUTBOX_LINGER_MS": "22"}
    config = config_from_args(["--config", path, "--batch-size", "31"], env)
    assert config.batch_size == 31  # flag over environment and file
    assert config.linger_ms == 22  # environment over file
    assert config.max_attempts == 13  # file over default
    assert config.poll_interval == PublisherConfig.poll_interval  # default
    assert config.database_url == "postgresql://db/app"


def test_the_config_file_can_be_named_by_the_environment(tmp_path: Path) -> None:
    """OUTBOX_CONFIG names the file when --config is not given; every kind of value is read."""
    path = _write(
        tmp_path,
        'database_url = "postgresql://from-file/app"\n'
        'kafka_bootstrap = "a:1,b:2"\n'
        "lease_seconds = 90\n"
        "auto_create_topics = false\n"
        'log_format = "JSON"\n'
        "http_port = 0\n",
    )
    config = config_from_args([], {"OUTBOX_CONFIG": path})
    assert config.database_url == "postgresql://from-file/app"
    assert config.kafka_bootstrap == "a:1,b:2"
    assert config.lease_seconds == 90.0
    assert isinstance(config.lease_seconds, float)
    assert config.auto_create_topics is False
    assert config.log_format == "json"
    assert config.http_port == 0


def test_an_empty_config_flag_reads_no_file_whatever_the_environment_says(tmp_path: Path) -> None:
    """A flag beats its variable: ``--config ""`` means no file, not OUTBOX_CONFIG's (for
    the publisher and for its reconcile command alike)."""
    path = _write(tmp_path, "batch_size = 7\n")
    env = {**BASE_ENV, "OUTBOX_CONFIG": path}
    assert config_from_args([], env).batch_size == 7
    assert config_from_args(["--config", ""], env).batch_size == PublisherConfig.batch_size
    path = _write(tmp_path, "absence_grace = 7\n")
    env = {**BASE_ENV, "OUTBOX_CONFIG": path}
    assert reconcile_config([], env).absence_grace == 7.0
    assert reconcile_config(["--config", ""], env).absence_grace == PublisherConfig.absence_grace


def test_boolean_flags_beat_the_environment() -> None:
    """--no-auto-create-topics and --exit-when-idle win over what the environment says."""
    env = {**BASE_ENV, "OUTBOX_AUTO_CREATE_TOPICS": "true", "OUTBOX_EXIT_WHEN_IDLE": "no"}
    config = config_from_args(["--no-auto-create-topics", "--exit-when-idle"], env)
    assert (config.auto_create_topics, config.exit_when_idle) == (False, True)
    config = config_from_args([], {**env, "OUTBOX_AUTO_CREATE_TOPICS": "0"})
    assert (config.auto_create_topics, config.exit_when_idle) == (False, False)


def test_an_empty_environment_variable_counts_as_unset() -> None:
    """OUTBOX_BATCH_SIZE= (empty, as compose files often leave it) falls back to the default."""
    config = config_from_args([], {**BASE_ENV, "OUTBOX_BATCH_SIZE": ""})
    assert config.batch_size == PublisherConfig.batch_size


def test_an_unknown_key_in_the_file_is_named_with_the_closest_known_key(tmp_path: Path) -> None:
    """A misspelt key is refused, with a suggestion, instead of being silently ignored."""
    path = _write(tmp_path, "batch_sise = 10\nfrobnicate = true\n")
    problems = _refusal(["--config", path], BASE_ENV)
    assert problems == [
        f"config file {path}: unknown key 'batch_sise' (did you mean 'batch_size'?)",
        f"config file {path}: unknown key 'frobnicate'",
    ]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('batch_size = "500"', 'batch_size = "500" is a string, expected an integer'),
        ("batch_size = 1.5", "batch_size = 1.5 is a float, expected an integer"),
        ("batch_size = true", "batch_size = true is a boolean, expected an integer"),
        ("poll_interval = false", "poll_interval = false is a boolean, expected a number"),
        ('exit_when_idle = "yes"', 'exit_when_idle = "yes" is a string, expected true or false'),
        ("http_host = [1]", "http_host = [...] is an array, expected a string"),
    ],
)
def test_a_value_of_the_wrong_type_in_the_file_names_key_value_and_type(
    tmp_path: Path, line: str, expected: str
) -> None:
    """A file value of the wrong TOML type is one problem line: key, value, what was expected."""
    path = _write(tmp_path, line + "\n")
    assert _refusal(["--config", path], BASE_ENV) == [f"config file {path}: {expected}"]


def test_integers_are_accepted_where_numbers_are_expected(tmp_path: Path) -> None:
    """poll_interval = 2 is as good as 2.0."""
    path = _write(tmp_path, "poll_interval = 2\n")
    assert config_from_args(["--config", path], BASE_ENV).poll_interval == 2.0


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {"OUTBOX_BATCH_SIZE": "lots"}, "OUTBOX_BATCH_SIZE='lots': expected an integer"),
        ([], {"OUTBOX_POLL_INTERVAL": "1s"}, "OUTBOX_POLL_INTERVAL='1s': expected a number"),
        ([], {"OUTBOX_POLL_INTERVAL": "nan"}, "expected a finite number"),
        ([], {"OUTBOX_EXIT_WHEN_IDLE": "maybe"}, "OUTBOX_EXIT_WHEN_IDLE='maybe': expected true"),
        (["--batch-size", "x"], {}, "--batch-size='x': expected an integer"),
        (["--http-port", "80.5"], {}, "--http-port='80.5': expected an integer"),
    ],
)
def test_a_malformed_flag_or_variable_is_a_problem_line_not_a_crash(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    """Malformed values from flags and variables are reported like every other problem."""
    problems = _refusal(argv, {**BASE_ENV, **env})
    assert len(problems) == 1, problems
    assert expected in problems[0]


def test_a_refused_value_adds_no_second_problem_about_the_same_setting(tmp_path: Path) -> None:
    """database_url = 5 is reported as the wrong type only, not also as a missing URL."""
    path = _write(tmp_path, 'database_url = 5\nkafka_bootstrap = "k:1"\n')
    assert _refusal(["--config", path], {}) == [
        f'config file {path}: database_url = "***" is an integer, expected a string'
    ]


def test_problems_from_every_source_are_listed_together(tmp_path: Path) -> None:
    """A bad file key, a bad variable and an impossible combination all come in one refusal."""
    path = _write(tmp_path, "lease_secs = 5\n")
    problems = _refusal(
        ["--config", path, "--lease-seconds", "5"], {**BASE_ENV, "OUTBOX_LINGER_MS": "soon"}
    )
    assert len(problems) == 4, problems
    assert any("unknown key 'lease_secs' (did you mean 'lease_seconds'?)" in p for p in problems)
    assert any("OUTBOX_LINGER_MS='soon'" in p for p in problems)
    assert any("lease (5s) must be longer than the longest a send can take" in p for p in problems)
    assert any("at most a third of the lease (5s)" in p for p in problems)


def test_a_missing_or_broken_config_file_is_a_problem(tmp_path: Path) -> None:
    """A file that cannot be read or is not TOML is named, with the reason."""
    missing = str(tmp_path / "nowhere.toml")
    assert _refusal(["--config", missing], BASE_ENV) == [
        f"config file {missing}: cannot be read: No such file or directory"
    ]
    broken = _write(tmp_path, "batch_size = = 3\n")
    (problem,) = _refusal(["--config", broken], BASE_ENV)
    assert problem.startswith(f"config file {broken}: not valid TOML: ")
    assert "line 1" in problem


def test_a_config_file_that_is_not_utf8_is_a_problem(tmp_path: Path) -> None:
    """A file written in UTF-16 (as some editors and shells do) is named, not a traceback."""
    path = tmp_path / "utf16.toml"
    path.write_text("batch_size = 3\n", encoding="utf-16")
    assert _refusal(["--config", str(path)], BASE_ENV) == [
        f"config file {path}: not UTF-8 (TOML files are UTF-8)"
    ]


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"lease_seconds": 1e20}, "lease seconds must be at most 31,536,000 seconds, got 1e+20"),
        (
            {"recovery_interval": 1e10},
            "recovery interval must be at most 31,536,000 seconds, got 1e+10",
        ),
        ({"batch_size": 10**20}, f"batch size must be at most 2,147,483,647, got {10**20:,}"),
        ({"max_block_ms": 2**31}, "max block ms must be at most 2,147,483,647, got 2,147,483,648"),
    ],
)
def test_a_number_past_what_clocks_columns_or_kafka_hold_is_refused(
    overrides: dict[str, Any], problem: str
) -> None:
    """Huge values were accepted, then failed at run time: a lease past what a timestamp
    holds, a batch size past a bigint, a timeout past Kafka's int32 (after charging the
    claimed messages a failure), an interval past what a thread can wait."""
    assert problem in _problems_of(replace(VALID, **overrides))


def test_the_largest_values_are_accepted() -> None:
    """A year of seconds and Kafka's largest int32 are still accepted."""
    replace(
        VALID, reconcile_interval=365 * 24 * 3600.0, max_attempts=2**31 - 1, batch_size=2**31 - 1
    ).validate()


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("postgresql://h/db?foo=bar", "does not parse: invalid URI query parameter"),
        ("postgresql://u@h:port/db", "has an invalid port 'port'"),
        ("postgresql://u@h:70000/db", "has an invalid port '70000'"),
        ("host=h dbname=x", "must start with postgresql://"),
    ],
)
def test_a_database_url_that_does_not_parse_is_refused(url: str, fragment: str) -> None:
    """The database URL must be a postgresql:// URL that libpq can parse."""
    (problem,) = _problems_of(replace(VALID, database_url=url))
    assert fragment in problem


def test_a_password_in_the_database_url_is_not_printed() -> None:
    """Problem lines show the database URL with its password masked."""
    (problem,) = _problems_of(replace(VALID, database_url="postgresql://u:s3cret@h:x/db"))
    assert "s3cret" not in problem
    assert "postgresql://u:***@h:x/db" in problem
    problems = _refusal([], {**BASE_ENV, "OUTBOX_DATABASE_URL": "mysql://u:s3cret@h/db"})
    assert problems == ["database URL 'mysql://u:***@h/db' must start with postgresql://"]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"http_port": -1}, "HTTP port must be 0 (off) or 1-65535, got -1"),
        ({"http_port": 65536}, "HTTP port must be 0 (off) or 1-65535, got 65536"),
        ({"http_host": " "}, "HTTP host is empty"),
        ({"log_level": "LOUD"}, "log level 'LOUD' is not one of DEBUG, INFO, WARNING, ERROR"),
        ({"log_format": "xml"}, "log format 'xml' is not one of text, json"),
        ({"kafka_bootstrap": "h:0"}, "'h:0' is not host:port"),
    ],
)
def test_new_settings_are_checked(overrides: dict[str, Any], fragment: str) -> None:
    """HTTP address, log settings and bootstrap ports are validated like the rest."""
    (problem,) = _problems_of(replace(VALID, **overrides))
    assert fragment in problem


def test_the_http_server_may_be_turned_off_with_any_host() -> None:
    """Port 0 serves nothing, so the host is not checked."""
    replace(VALID, http_port=0, http_host="").validate()


def test_log_level_is_accepted_in_any_case() -> None:
    """OUTBOX_LOG_LEVEL=debug means DEBUG."""
    config = config_from_args([], {**BASE_ENV, "OUTBOX_LOG_LEVEL": "debug"})
    assert config.log_level == "DEBUG"


def test_every_setting_has_one_flag_variable_and_key_and_a_field() -> None:
    """Each declaration names a PublisherConfig field; flags, variables and keys are unique."""
    names = {s.name for s in SETTINGS}
    assert names == {f.name for f in fields(PublisherConfig)}
    for attribute in ("flag", "env", "key"):
        values = [getattr(s, attribute) for s in SETTINGS]
        assert len(values) == len(set(values)), attribute
    assert {s.env for s in SETTINGS} >= {
        "OUTBOX_HTTP_HOST",
        "OUTBOX_HTTP_PORT",
        "OUTBOX_LOG_FORMAT",
    }


def test_help_names_every_flag_its_variable_and_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--help lists each setting with its environment variable and default."""
    with pytest.raises(SystemExit):
        config_from_args(["--help"], {})
    text = " ".join(capsys.readouterr().out.split())
    for s in SETTINGS:
        assert s.flag in text
        assert s.env in text
    assert "(default 9187) [OUTBOX_HTTP_PORT]" in text
    assert "[OUTBOX_CONFIG]" in text


def _problems_of(config: PublisherConfig) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config.validate()
    return _problems(caught.value)


def test_a_refused_file_value_overridden_by_a_flag_is_still_checked(tmp_path: Path) -> None:
    """lease_seconds = "long" in the file, --lease-seconds 30 given: both problems are named."""
    path = _write(tmp_path, 'lease_seconds = "long"\n')
    problems = _refusal(["--config", path, "--lease-seconds", "30"], BASE_ENV)
    assert len(problems) == 2, problems
    assert (
        problems[0] == f'config file {path}: lease_seconds = "long" is a string, expected a number'
    )
    assert problems[1].startswith("lease (30s) must be longer than the longest a send can take")


def test_reconcile_takes_the_absence_grace_as_the_publisher_does(tmp_path: Path) -> None:
    """``outbox-publisher reconcile`` takes the absence grace from its flag, the
    environment or the publisher's config file (whose other keys it ignores), and refuses
    a negative one: a grace shorter than the brokers' could prove a present record absent."""
    path = _write(tmp_path, "absence_grace = 90\nbatch_size = 11\n")
    assert reconcile_config([], BASE_ENV).absence_grace == PublisherConfig.absence_grace
    assert reconcile_config(["--config", path], BASE_ENV).absence_grace == 90.0
    env = {**BASE_ENV, "OUTBOX_CONFIG": path, "OUTBOX_ABSENCE_GRACE": "120"}
    assert reconcile_config([], env).absence_grace == 120.0
    assert reconcile_config(["--absence-grace", "150"], env).absence_grace == 150.0
    with pytest.raises(ConfigError) as caught:
        reconcile_config(["--absence-grace", "-30"], BASE_ENV)
    assert _problems(caught.value) == ["absence grace must be 0 or more, got -30.0"]


def test_the_default_absence_grace_outlasts_a_follower_dropped_from_the_isr() -> None:
    """A record the leader wrote becomes readable once every in-sync follower copied it or
    was dropped; a leader checks its followers every half of replica.lag.time.max.ms
    (Kafka's default 30 s) and drops those behind by that much, so a dropped follower can
    hide the record for 1.5 times it, and the controller's answer after that."""
    kafka_replica_lag_time_max = 30.0
    assert PublisherConfig.absence_grace > 1.5 * kafka_replica_lag_time_max
    assert reconcile_config([], BASE_ENV).absence_grace == PublisherConfig.absence_grace


def test_reconcile_judges_only_its_own_keys_of_the_publishers_config_file(
    tmp_path: Path,
) -> None:
    """A bad value of a key it does not use is the publisher's to refuse (as the same
    value in that key's variable is ignored); an unknown key is still refused."""
    path = _write(tmp_path, 'absence_grace = 90\nhttp_port = "zero"\n')
    assert reconcile_config(["--config", path], BASE_ENV).absence_grace == 90.0
    typo = _write(tmp_path, "absence_grase = 90\n")
    with pytest.raises(ConfigError, match="unknown key 'absence_grase'"):
        reconcile_config(["--config", typo], BASE_ENV)


def test_reconcile_names_what_is_missing() -> None:
    """With no database or Kafka, every missing setting is named with its flag and variable."""
    with pytest.raises(ConfigError) as caught:
        reconcile_config([], {})
    assert _problems(caught.value) == [
        "database URL is missing (--database-url or OUTBOX_DATABASE_URL)",
        "Kafka bootstrap servers are missing (--kafka-bootstrap or OUTBOX_KAFKA_BOOTSTRAP)",
    ]


@pytest.mark.parametrize(
    ("flags", "environ"),
    [
        (["--purge-delivered-after", "off"], {}),
        ([], {"OUTBOX_PURGE_DELIVERED_AFTER": "OFF"}),
        (["--purge-delivered-after", "7d", "--purge-delivered-after", "off"], {}),
    ],
)
def test_retention_off_is_the_word_its_default_is_shown_as(
    flags: list[str], environ: dict[str, str]
) -> None:
    """--help shows retention's default as "off": the word turns it off, not "not a
    duration"."""
    base = {"OUTBOX_DATABASE_URL": "postgresql://u@h/db", "OUTBOX_KAFKA_BOOTSTRAP": "k:9092"}
    config = config_from_args(flags, environ={**base, **environ})
    assert config.purge_delivered_after == ""


def test_python_values_take_paths_and_none_and_name_other_types(tmp_path: Path) -> None:
    """publisher.testing passes Python values: a Path is a path, None leaves the default,
    and a value of another type is named by its type."""
    base = {"database_url": "postgresql://u@h/db", "kafka_bootstrap": "k:9092"}
    ca = tmp_path / "ca.pem"
    ca.write_text(CA_PEM)
    config = config_from_values(
        {**base, "kafka_security_protocol": "SSL", "kafka_ssl_cafile": ca, "batch_size": None}
    )
    assert config.kafka_ssl_cafile == str(ca)
    assert config.batch_size == PublisherConfig.batch_size
    with pytest.raises(ConfigError, match=r"batch_size = b'10' is a bytes, expected an integer"):
        config_from_values({**base, "batch_size": b"10"})


def test_a_delivered_window_past_30_days_needs_no_evidence_window() -> None:
    """The evidence window defaults to 30 days, or to the delivered window when that is
    longer: a longer delivered window alone was refused for the default evidence window."""
    replace(VALID, purge_delivered_after="60d").validate()
    assert evidence_age_for(timedelta(days=60)) == timedelta(days=60)
    assert evidence_age_for(timedelta(days=7)) == DEFAULT_EVIDENCE_AGE == timedelta(days=30)
    (problem,) = _problems_of(
        replace(VALID, purge_delivered_after="60d", purge_evidence_after="30d")
    )
    assert "purge evidence after (30d) must be at least purge delivered after (60d)" in problem


def test_reconcile_after_other_flags_is_named_with_where_it_goes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`outbox-publisher --database-url URL reconcile` said only "unrecognized arguments:
    ...": the command word is shown (it is no secret) with where it belongs, and a value
    after it is still not repeated."""
    with pytest.raises(SystemExit) as exited:
        config_from_args(
            [
                "--database-url",
                "postgresql://h/db",
                "reconcile",
                "--kafka-sasl-password",
                "hunter2",
            ],
            BASE_ENV,
        )
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert (
        "unrecognized arguments: reconcile --kafka-sasl-password ... "
        "(reconcile comes first: outbox-publisher reconcile [OPTIONS])"
    ) in err
    assert "hunter2" not in err

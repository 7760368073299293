"""Kafka security settings: validation, secrets kept out of sight, one mapping per library."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from kafka import errors as kafka_errors

from publisher.app import build_app
from publisher.cli import _parser, config_from_args
from publisher.config import ConfigError, PublisherConfig, resolve
from publisher.kafka_security import (
    KAFKA_PYTHON_FIXED,
    LIBRDKAFKA_FIXED,
    KafkaSecurity,
    _noting_refusals,
    refusal_since,
    refuse_fixed,
)
from publisher.sink import KafkaSink, KafkaSinkConfig
from tests.support import CA_PEM

SECRET = "s3cret-Pa55"  # noqa: S105 - a test value, checked to appear nowhere
BASE = {"OUTBOX_DATABASE_URL": "postgresql://u@h/db", "OUTBOX_KAFKA_BOOTSTRAP": "k:9093"}


def _sasl_env(**more: str) -> dict[str, str]:
    return {
        **BASE,
        "OUTBOX_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
        "OUTBOX_KAFKA_SASL_MECHANISM": "scram-sha-512",
        "OUTBOX_KAFKA_SASL_USERNAME": "outbox",
        **more,
    }


def test_defaults_are_plaintext_with_hostname_checks_on() -> None:
    """Without settings the clients speak PLAINTEXT; TLS would check the broker's name."""
    config = resolve({}, BASE)
    security = KafkaSecurity.from_config(config)
    assert security.kafka_python() == {"security_protocol": "PLAINTEXT"}
    assert security.librdkafka() == {"security.protocol": "plaintext"}
    assert config.kafka_ssl_check_hostname is True


#: A client certificate and its key, encrypted with CLIENT_KEY_PASSWORD.
CLIENT_CERT_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBmjCCAUGgAwIBAgIUZMqKpB3cxqpXXkSTpb2avH2ZYIAwCgYIKoZIzj0EAwIw
IjEgMB4GA1UEAwwXb3V0Ym94IHVuaXQtdGVzdCBjbGllbnQwIBcNMjYxMjAzMjEx
NjA1WhgPMjEyNjExMDkyMTE2MDVaMCIxIDAeBgNVBAMMF291dGJveCB1bml0LXRl
c3QgY2xpZW50MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEFqC99fbwEXmPVImq
T5CA9h4AIm/u32qG1hr/UX+2Sga7qA+uCNREKVagIgd5GhLiDDBp2syqy6RpzM9/
KtOtnqNTMFEwHQYDVR0OBBYEFM0fWfrSx0tWYb0bJXyRMOhPusCUMB8GA1UdIwQY
MBaAFM0fWfrSx0tWYb0bJXyRMOhPusCUMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZI
zj0EAwIDRwAwRAIgHSrUDLoakwDGatcTeFeybwwrN7CHf2vEFDkofBX+md4CICxu
aG2Zbc1SFm1TGPWwHk4XVPHaYIIA02sldSSyS6Jk
-----END CERTIFICATE-----
"""
CLIENT_KEY_PEM = """\
-----BEGIN ENCRYPTED PRIVATE KEY-----
MIHjME4GCSqGSIb3DQEFDTBBMCkGCSqGSIb3DQEFDDAcBAjI2Zp5bYpOQwICCAAw
DAYIKoZIhvcNAgkFADAUBggqhkiG9w0DBwQITx0BeSXNVj8EgZAyOMiZtP5QtRQd
SsJZ7La2BOwXCKZqfkm9diwJJ6+pcZJtQ+SgQOeOwZNN8KHiy6qH82+iaVfAsv+i
ieOTlSZqK8hiwh7b7OEyuaq0hkrjqPVe0rcGV50duzy2d9wG624LYLNgzsRAH/xh
uIjR4dQijCzZdxyzSLkyR0IqkUJLiuWlJ1n2PRKB/PAp/c/+bto=
-----END ENCRYPTED PRIVATE KEY-----
"""
CLIENT_KEY_PASSWORD = "unit-test-pw"  # noqa: S105 - the test key's, nothing else's


def test_an_encrypted_key_without_its_password_is_refused_without_a_prompt(
    tmp_path: Path,
) -> None:
    """OpenSSL would ask for the passphrase on the terminal (and hang a command run from
    a shell): refused instead, naming the settings; with its password it loads."""
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    cert.write_text(CLIENT_CERT_PEM)
    key.write_text(CLIENT_KEY_PEM)
    env = {
        **BASE,
        "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SSL",
        "OUTBOX_KAFKA_SSL_CERTFILE": str(cert),
        "OUTBOX_KAFKA_SSL_KEYFILE": str(key),
    }
    with pytest.raises(ConfigError, match="an encrypted key needs OUTBOX_KAFKA_SSL_KEY_PASSWORD"):
        KafkaSecurity.from_config(resolve({}, env))
    with_password = {**env, "OUTBOX_KAFKA_SSL_KEY_PASSWORD": CLIENT_KEY_PASSWORD}
    assert KafkaSecurity.from_config(resolve({}, with_password)).tls


def test_sasl_ssl_from_environment_maps_to_both_libraries(tmp_path: Path) -> None:
    """The same settings become kafka-python arguments and librdkafka properties."""
    ca = tmp_path / "ca.pem"
    ca.write_text(CA_PEM)
    config = resolve(
        {}, _sasl_env(OUTBOX_KAFKA_SASL_PASSWORD=SECRET, OUTBOX_KAFKA_SSL_CAFILE=str(ca))
    )
    security = KafkaSecurity.from_config(config)
    assert security.kafka_python() == {
        "security_protocol": "SASL_SSL",
        "ssl_check_hostname": True,
        "ssl_cafile": str(ca),
        "ssl_certfile": None,
        "ssl_keyfile": None,
        "ssl_password": None,
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "outbox",
        "sasl_plain_password": SECRET,
    }
    assert security.librdkafka() == {
        "security.protocol": "sasl_ssl",
        "ssl.endpoint.identification.algorithm": "https",
        "ssl.ca.location": str(ca),
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "outbox",
        "sasl.password": SECRET,
    }


def test_password_file_is_read_and_never_shown(tmp_path: Path) -> None:
    """The password comes from the first line of its file; no repr shows it."""
    secret_file = tmp_path / "password"
    secret_file.write_text(SECRET + "\nignored\n")
    config = resolve({"kafka_sasl_password_file": str(secret_file)}, _sasl_env())
    security = KafkaSecurity.from_config(config)
    assert security.sasl_password == SECRET
    assert SECRET not in repr(security)
    assert SECRET not in repr(resolve({}, _sasl_env(OUTBOX_KAFKA_SASL_PASSWORD=SECRET)))


def test_there_is_no_password_flag() -> None:
    """A password flag would show in ps: argparse knows none, for SASL nor for the TLS key."""
    flags = {a for action in _parser()._actions for a in action.option_strings}
    assert "--kafka-sasl-password-file" in flags
    assert "--kafka-sasl-password" not in flags
    assert "--kafka-ssl-key-password" not in flags
    # Nor is it taken as an abbreviation of --kafka-sasl-password-file.
    with pytest.raises(SystemExit):
        config_from_args(["--kafka-sasl-password", SECRET], environ=BASE)


def test_sasl_without_its_settings_names_each_missing_one() -> None:
    """SASL_SSL without mechanism, user or password: every gap is named, in one refusal."""
    with pytest.raises(ConfigError) as refused:
        resolve({}, {**BASE, "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})
    text = str(refused.value)
    assert "needs a SASL mechanism" in text
    assert "needs a SASL username" in text
    assert (
        "needs a SASL password (OUTBOX_KAFKA_SASL_PASSWORD, or --kafka-sasl-password-file" in text
    )


def test_unknown_protocol_and_mechanism_are_refused() -> None:
    """OAUTHBEARER and GSSAPI are not settings here; a typo'd protocol is refused."""
    with pytest.raises(ConfigError, match="'SASL_TLS' is not one of PLAINTEXT, SSL"):
        resolve({}, {**BASE, "OUTBOX_KAFKA_SECURITY_PROTOCOL": "sasl_tls"})
    with pytest.raises(ConfigError, match="'OAUTHBEARER' is not one of PLAIN, SCRAM-SHA-256"):
        resolve(
            {},
            _sasl_env(OUTBOX_KAFKA_SASL_MECHANISM="oauthbearer", OUTBOX_KAFKA_SASL_PASSWORD="x"),  # noqa: S106
        )


def test_secret_errors_never_repeat_the_secret(tmp_path: Path) -> None:
    """Both a password and a password file given: refused, and the message hides the value."""
    secret_file = tmp_path / "password"
    secret_file.write_text(SECRET)
    with pytest.raises(ConfigError) as refused:
        resolve(
            {"kafka_sasl_password_file": str(secret_file)},
            _sasl_env(OUTBOX_KAFKA_SASL_PASSWORD=SECRET),
        )
    assert "not both" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_settings_for_another_protocol_are_refused_not_ignored(tmp_path: Path) -> None:
    """SASL or TLS settings with PLAINTEXT would silently not be used: refused instead."""
    with pytest.raises(ConfigError) as refused:
        resolve({"kafka_sasl_username": "u", "kafka_ssl_cafile": str(tmp_path)}, BASE)
    text = str(refused.value)
    assert "--kafka-sasl-username) are set, but the security protocol is PLAINTEXT" in text
    assert "--kafka-ssl-cafile) are set, but the security protocol is PLAINTEXT" in text


def test_settings_for_another_protocol_are_named_as_they_can_be_given() -> None:
    """A secret has no flag: it is named by its variable; turning hostname checks off
    without TLS is refused too, not ignored."""
    env = {**BASE, "OUTBOX_KAFKA_SASL_PASSWORD": SECRET}
    with pytest.raises(ConfigError) as refused:
        config_from_args(["--no-kafka-ssl-check-hostname"], environ=env)
    text = str(refused.value)
    assert "(OUTBOX_KAFKA_SASL_PASSWORD) are set, but the security protocol is PLAINTEXT" in text
    assert "(--no-kafka-ssl-check-hostname) are set, but the security protocol is" in text
    assert SECRET not in text


def test_a_key_password_without_a_key_and_an_empty_key_password_file_are_refused(
    tmp_path: Path,
) -> None:
    """A key password with nothing to open, or from an empty file, would be ignored."""
    empty = tmp_path / "key-password"
    empty.write_text("")
    tls = {**BASE, "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SSL"}
    with pytest.raises(ConfigError) as refused:
        resolve({"kafka_ssl_key_password_file": str(empty)}, tls)
    text = str(refused.value)
    assert "a Kafka TLS key password is set, but no key (--kafka-ssl-keyfile)" in text
    assert f"--kafka-ssl-key-password-file {empty}: the file is empty" in text


def test_a_password_file_whose_first_line_is_blank_or_not_utf8_is_refused(
    tmp_path: Path,
) -> None:
    """The secret is the file's first line: a blank one, or bytes that are not UTF-8 (a
    file saved as UTF-16), is named at start, not a traceback or an empty password."""
    blank = tmp_path / "blank"
    blank.write_text("\nthe password on the second line\n")
    utf16 = tmp_path / "utf16"
    utf16.write_text("password\n", encoding="utf-16")
    tls = {**BASE, "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SSL", "OUTBOX_KAFKA_SSL_KEYFILE": ""}
    for path, problem in (
        (blank, "its first line is empty (the secret is read from the first line)"),
        (utf16, "its first line is not UTF-8"),
    ):
        with pytest.raises(ConfigError) as refused:
            resolve({"kafka_ssl_key_password_file": str(path)}, tls)
        assert f"--kafka-ssl-key-password-file {path}: {problem}" in str(refused.value)


def test_unreadable_files_are_named_at_start(tmp_path: Path) -> None:
    """A CA file or password file that cannot be read is a configuration error naming it."""
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError) as refused:
        resolve(
            {"kafka_ssl_cafile": str(missing), "kafka_sasl_password_file": str(missing)},
            _sasl_env(),
        )
    assert f"--kafka-ssl-cafile {missing}: cannot be read" in str(refused.value)
    assert "--kafka-sasl-password-file: the file cannot be read" in str(refused.value)


@pytest.mark.parametrize("name", ["kafka_sasl_password_file", "kafka_ssl_key_password_file"])
def test_a_password_given_as_a_password_file_is_not_shown(name: str) -> None:
    """A password typed where its file's path goes is not echoed in the problem."""
    with pytest.raises(ConfigError) as refused:
        resolve({name: SECRET}, _sasl_env())
    text = str(refused.value)
    assert f"--{name.replace('_', '-')}: the file cannot be read" in text
    assert SECRET not in text


def test_hostname_checks_turn_off_only_on_purpose() -> None:
    """--no-kafka-ssl-check-hostname turns them off, and librdkafka hears the same."""
    config = config_from_args(
        ["--no-kafka-ssl-check-hostname"],
        environ={**BASE, "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SSL"},
    )
    security = KafkaSecurity.from_config(config)
    assert security.kafka_python()["ssl_check_hostname"] is False
    assert security.librdkafka()["ssl.endpoint.identification.algorithm"] == "none"


@pytest.mark.parametrize(
    "key",
    [
        "acks",
        "enable_idempotence",
        "max_in_flight_requests_per_connection",
        "retries",
        "sasl_oauth_token_provider",
        "sasl_kerberos_service_name",
        "ssl_crlfile",
        "ssl_ciphers",
        "proxy_url",
    ],
)
def test_kafka_sink_refuses_extras_that_weaken_delivery(key: str) -> None:
    """kafka-python extras may not override what delivery relies on: refused, naming the key."""
    with pytest.raises(ConfigError, match=f"kafka-python setting '{key}' cannot be set"):
        KafkaSink(KafkaSinkConfig("k:9092", extra={key: 1}))


@pytest.mark.parametrize(
    "key",
    [
        "acks",
        "enable.idempotence",
        "transactional.id",
        "max.in.flight",
        "sasl.password",
        "sasl.kerberos.service.name",
        "ssl.cipher.suites",
        "default.topic.config",
    ],
)
def test_librdkafka_extras_that_weaken_delivery_or_security_are_refused(key: str) -> None:
    """The confluent sink's extras are checked against librdkafka's names (and aliases)."""
    with pytest.raises(ConfigError, match=f"librdkafka setting '{key}' cannot be set"):
        refuse_fixed({key: "x", "compression.type": "lz4"}, LIBRDKAFKA_FIXED, "librdkafka")


def test_harmless_extras_pass() -> None:
    """Compression and the like stay free to set."""
    refuse_fixed({"compression_type": "gzip"}, KAFKA_PYTHON_FIXED, "kafka-python")
    refuse_fixed({"compression.type": "lz4"}, LIBRDKAFKA_FIXED, "librdkafka")
    assert KafkaSink(KafkaSinkConfig("k:9092", extra={"compression_type": "gzip"}))


def test_config_repr_hides_both_passwords() -> None:
    """Neither password field appears in a config's repr (logged by mistake, it shows none)."""
    config = PublisherConfig(
        "postgresql://u@h/db", "k:1", kafka_sasl_password=SECRET, kafka_ssl_key_password=SECRET
    )
    assert SECRET not in repr(config)


def test_a_secret_typed_after_a_flag_that_does_not_exist_is_not_echoed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """There is no password flag; argparse would echo the unrecognized words, the secret
    among them: only the option's name is shown."""
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["--kafka-sasl-password", "s3cret-typed", "--pw=other-s3cret"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --kafka-sasl-password ... --pw" in err
    assert "s3cret" not in err


def test_a_connection_dropped_mid_login_is_noted_but_stays_a_connection_error() -> None:
    """A login cut off is noted for the start-up check, which names it; the error stays a
    connection error, which kafka-python retries, not an authentication failure, which it
    would keep against the broker until the process ends."""

    async def dropped(self: object, timeout_at: float | None = None) -> None:
        raise kafka_errors.KafkaConnectionError("socket disconnected")

    start = time.monotonic()
    login = _noting_refusals(dropped)
    with pytest.raises(kafka_errors.KafkaConnectionError):
        asyncio.run(login(SimpleNamespace(config={"sasl_mechanism": "SCRAM-SHA-512"})))
    reason = refusal_since(start)
    assert reason is not None
    assert "closed the connection during the SCRAM-SHA-512 login" in reason


def test_the_login_check_checks_the_password_the_clients_were_built_with(tmp_path: Path) -> None:
    """The password file is read once, when the publisher is built: a file rotated before
    the login check does not make the check test a password the clients do not use."""
    secret_file = tmp_path / "password"
    secret_file.write_text(SECRET + "\n")
    config = config_from_args(
        ["--kafka-sasl-password-file", str(secret_file), "--http-port", "0"],
        environ=_sasl_env(),
    )
    app = build_app(config)
    secret_file.write_text("rotated\n")

    assert app.publisher.sink._config.security is app.security  # type: ignore[attr-defined]
    assert app.security.kafka_python()["sasl_plain_password"] == SECRET


def test_a_tls_file_that_does_not_load_is_named_with_every_other_problem(tmp_path: Path) -> None:
    """A CA file that is no PEM was refused only once the rest was right (a second start
    to find it): it is one more problem line of the same refusal now."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    env = {
        **BASE,
        "OUTBOX_BATCH_SIZE": "0",
        "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SSL",
        "OUTBOX_KAFKA_SSL_CAFILE": str(ca),
    }
    with pytest.raises(ConfigError) as refused:
        resolve({}, env)
    lines = str(refused.value).splitlines()[1:]
    assert [line.strip() for line in lines] == [
        "batch size must be at least 1, got 0",
        f"--kafka-ssl-cafile {ca}: no CA certificate could be loaded from it "
        "(NO_CERTIFICATE_OR_CRL_FOUND); it must hold PEM certificates",
    ]

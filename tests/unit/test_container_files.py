"""compose.yaml and the Dockerfile: the publisher's healthcheck works, the wiring holds.

There is no container engine here. The healthcheck command is taken from
compose.yaml and run as it would run in the container, against a small HTTP
server standing in for the publisher's /readyz. Where a `docker compose`
binary is installed, it validates the file and the wiring is read from its
normalised model; hadolint lints the Dockerfile where it is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
HTTP_PORT = 9187  # the publisher's default OUTBOX_HTTP_PORT


def _compose_model() -> dict[str, Any] | None:
    """`docker compose config` as JSON, or None without a compose binary."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    version = subprocess.run(
        [docker, "compose", "version"], capture_output=True, check=False, timeout=30
    )
    if version.returncode != 0:
        return None
    done = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=ROOT,
    )
    model: dict[str, Any] = json.loads(done.stdout)
    return model


@pytest.fixture(scope="module")
def compose_model() -> dict[str, Any]:
    """The compose file as `docker compose` reads it (skips without a compose binary)."""
    model = _compose_model()
    if model is None:
        pytest.skip("no `docker compose` binary to read compose.yaml with")
    return model


def healthcheck_from_text() -> list[str]:
    """The publisher's healthcheck test, read from compose.yaml's text.

    The project has no YAML parser, so this reads the one shape the file
    uses: a block list whose last item is a folded (``>-``) scalar.
    """
    lines = COMPOSE.read_text().splitlines()
    i = lines.index("  publisher:")
    while lines[i].strip() != "test:":
        i += 1
    i += 1
    items: list[str] = []
    while lines[i].strip().startswith("- "):
        item = lines[i].strip()[2:]
        i += 1
        if item != ">-":
            items.append(item)
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        folded = []
        while lines[i].startswith(" " * indent) and lines[i].strip():
            folded.append(lines[i].strip())
            i += 1
        items.append(" ".join(folded))
    return items


class _Readyz(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def readyz() -> Iterator[ThreadingHTTPServer]:
    """A stand-in for the publisher's endpoints on a free local port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Readyz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _run_healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    test = healthcheck_from_text()
    assert test[:3] == ["CMD", "python", "-c"]
    # In the image `python` is the venv's; here the test's own interpreter.
    return subprocess.run(
        [sys.executable, *test[2:]],
        env={**os.environ, "OUTBOX_HTTP_PORT": str(port)},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False), (204, False)])
def test_the_healthcheck_passes_only_on_200_from_readyz(
    readyz: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch, status: int, healthy: bool
) -> None:
    """The compose healthcheck exits 0 when /readyz answers 200 and non-zero on any other status."""
    monkeypatch.setattr(_Readyz, "status", status)
    result = _run_healthcheck(readyz.server_address[1])
    assert (result.returncode == 0) is healthy, result.stderr


def test_the_healthcheck_fails_when_nothing_listens(readyz: ThreadingHTTPServer) -> None:
    """A publisher that is not serving (yet) is unhealthy: the command exits non-zero."""
    port = readyz.server_address[1]
    readyz.shutdown()
    readyz.server_close()
    assert _run_healthcheck(port).returncode != 0


def test_compose_reads_the_healthcheck_as_the_test_does(compose_model: dict[str, Any]) -> None:
    """`docker compose config` accepts the file and folds the healthcheck to the same command."""
    healthcheck = compose_model["services"]["publisher"]["healthcheck"]
    assert healthcheck["test"] == healthcheck_from_text()


def test_compose_publishes_the_publisher_endpoints_on_localhost_and_gates_on_health(
    compose_model: dict[str, Any],
) -> None:
    """Port 9187 is published on 127.0.0.1 only and the demo waits for a healthy publisher."""
    services = compose_model["services"]
    publisher = services["publisher"]
    assert publisher["environment"]["OUTBOX_HTTP_PORT"] == str(HTTP_PORT)
    assert [(p["host_ip"], p["target"]) for p in publisher["ports"]] == [("127.0.0.1", HTTP_PORT)]
    assert all(p["host_ip"] == "127.0.0.1" for s in services.values() for p in s.get("ports", []))
    assert services["demo"]["depends_on"]["publisher"]["condition"] == "service_healthy"
    assert publisher["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # The image's default command is the publisher; migrate names its own.
    assert publisher.get("command") is None
    assert publisher.get("entrypoint") is None
    assert services["migrate"]["command"] == ["outbox", "migrate", "--create-roles"]


def _final_stage(dockerfile: str) -> str:
    stages = re.split(r"^FROM ", dockerfile, flags=re.M)
    return stages[-1]


def test_the_image_is_multi_stage_non_root_and_serves_the_metrics_port() -> None:
    """Build and runtime stages; the runtime installs nothing, runs as a numeric non-root user."""
    dockerfile = DOCKERFILE.read_text()
    assert re.findall(r"^FROM \S+ AS (\w+)$", dockerfile, flags=re.M) == ["build", "runtime"]
    runtime = _final_stage(dockerfile)
    assert re.search(r"^COPY --from=build /opt/venv /opt/venv$", runtime, flags=re.M)
    assert not re.search(r"apt-get|pip |pip3 |gcc|build-essential", runtime)
    [user] = re.findall(r"^USER (\d+):(\d+)$", runtime, flags=re.M)
    assert int(user[0]) != 0
    assert int(user[1]) != 0
    assert re.findall(r"^EXPOSE (.+)$", runtime, flags=re.M) == [str(HTTP_PORT)]
    assert re.findall(r"^CMD (.+)$", runtime, flags=re.M) == ['["outbox-publisher"]']
    assert not re.search(r"^ENTRYPOINT", runtime, flags=re.M)


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    """hadolint, where installed, reports no rule broken."""
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed")
    result = subprocess.run(
        [hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_connects_each_component_as_its_own_login_never_the_superuser() -> None:
    """Every OUTBOX_DATABASE_URL in compose.yaml names a login the init script makes, in the
    role its component needs; none is the superuser."""
    compose = COMPOSE.read_text()
    init = (ROOT / "deploy" / "postgres-init" / "10-outbox-logins.sh").read_text()
    urls = dict(
        re.findall(
            r"^  (\w+):\n(?:    .*\n)*?      OUTBOX_DATABASE_URL: postgresql://(\w+):",
            compose,
            flags=re.M,
        )
    )
    assert urls == {
        "migrate": "outbox_owner",
        "publisher": "publisher",
        "demo": "demo",
        "operator": "operator",
    }
    assert "POSTGRES_USER: postgres" in compose
    assert "./deploy/postgres-init:/docker-entrypoint-initdb.d:ro" in compose
    for login, role in [
        ("demo", "outbox_writer"),
        ("publisher", "outbox_publisher"),
        ("operator", "outbox_operator"),
    ]:
        assert re.search(
            rf"^CREATE ROLE {login} LOGIN PASSWORD :'\w+' IN ROLE {role};$", init, re.M
        )
    assert 'ALTER DATABASE :"DBNAME" OWNER TO outbox_owner;' in init
    assert "SUPERUSER" not in init

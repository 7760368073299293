"""services/up and services/kafka-node: wrong input is refused before anything starts.

Each test runs the scripts from a copy of ``services/`` in a temporary
directory, so their ``.services/`` is a fresh one and nothing of this
checkout's services is touched; none of them starts PostgreSQL or Kafka. The
metadata probe that ``services/up`` waits with is run against a small TCP
server answering as a broker would, the check for a port a client took
against sockets of the test itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Settings of the caller's shell that would change what the scripts do.
CLEARED = ("OUTBOX_DATABASE_URL", "OUTBOX_KAFKA_BOOTSTRAP", "OUTBOX_KAFKA_BROKERS")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A directory holding a copy of ``services/`` and nothing else."""
    shutil.copytree(ROOT / "services", tmp_path / "services")
    return tmp_path


def run(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """One of the scripts of ``repo``, with the environment given and none of CLEARED."""
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    return subprocess.run(
        [str(repo / "services" / args[0]), *args[1:]],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize("brokers", ["2", "0", "4", "three", " 3"])
def test_up_refuses_a_broker_count_other_than_1_or_3(repo: Path, brokers: str) -> None:
    """OUTBOX_KAFKA_BROKERS must be 1 or 3: anything else is a usage error (exit 2), before
    anything is created."""
    result = run(repo, "up", OUTBOX_KAFKA_BROKERS=brokers)
    assert result.returncode == 2, result.stderr
    assert "OUTBOX_KAFKA_BROKERS must be 1 (one broker) or 3" in result.stderr
    assert f"got '{brokers}'" in result.stderr
    assert "usage: [OUTBOX_KAFKA_BROKERS=1|3] services/up" in result.stderr
    assert not (repo / ".services").exists()
    assert not (repo / ".services.env").exists()


def test_up_refuses_cluster_ports_that_collide_with_node_1s(repo: Path) -> None:
    """With three brokers, a controller port where node 2's client port goes is refused,
    naming the node and the port, before anything is created."""
    result = run(
        repo,
        "up",
        OUTBOX_KAFKA_BROKERS="3",
        OUTBOX_KAFKA_PORT="40000",
        OUTBOX_KAFKA_CONTROLLER_PORT="40003",
        OUTBOX_KAFKA_SASL_PORT="40002",
    )
    assert result.returncode == 1
    assert "Kafka node 2's port 40003 is taken" in result.stderr
    assert not (repo / ".services").exists()


def test_up_refuses_cluster_ports_above_65535(repo: Path) -> None:
    """Node 3's ports lie up to OUTBOX_KAFKA_PORT+8; past 65535 is refused."""
    result = run(
        repo, "up", OUTBOX_KAFKA_BROKERS="3", OUTBOX_KAFKA_PORT="65530", OUTBOX_KAFKA_SASL_PORT="0"
    )
    assert result.returncode == 1
    assert "Kafka node 3 would need port 65536" in result.stderr
    assert not (repo / ".services").exists()


def test_up_help_describes_the_broker_count_and_the_ports_of_the_nodes(repo: Path) -> None:
    """--help names OUTBOX_KAFKA_BROKERS, the ports of nodes 2 and 3, and services/kafka-node."""
    result = run(repo, "up", "--help")
    assert result.returncode == 0
    assert "OUTBOX_KAFKA_BROKERS (1 or 3, default 1)" in result.stdout
    assert "node 2 has OUTBOX_KAFKA_PORT+3, +4 and +5" in result.stdout
    assert "services/kafka-node" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no command"),
        (("restart", "1"), "unknown command 'restart'"),
        (("--force",), "unknown option '--force'"),
        (("kill",), "'kill' needs a node number"),
        (("kill", "0"), "must be 1, 2 or 3, got '0'"),
        (("start", "4"), "must be 1, 2 or 3, got '4'"),
        (("pid", "one"), "must be 1, 2 or 3, got 'one'"),
        (("stop", "1", "2"), "'stop' takes one node number, got: 1 2"),
        (("status", "1"), "'status' takes no arguments"),
    ],
)
def test_kafka_node_refuses_wrong_arguments(
    repo: Path, args: tuple[str, ...], message: str
) -> None:
    """A wrong command line exits 2 with the reason and the usage line."""
    result = run(repo, "kafka-node", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "usage: services/kafka-node" in result.stderr


def test_kafka_node_help_lists_every_command(repo: Path) -> None:
    """--help describes kill, stop, start, pid, port and status."""
    result = run(repo, "kafka-node", "--help")
    assert result.returncode == 0
    for command in ("kill N", "stop N", "start N", "pid N", "port N", "status"):
        assert f"services/kafka-node {command}" in result.stdout


def test_kafka_node_says_when_no_kafka_was_started_here(repo: Path) -> None:
    """Before any services/up there is no node to act on: exit 1, saying to run it."""
    result = run(repo, "kafka-node", "pid", "1")
    assert result.returncode == 1
    assert "run services/up first" in result.stderr


def test_kafka_node_knows_only_node_1_of_a_single_broker(repo: Path) -> None:
    """When services/up last ran one broker, nodes 2 and 3 are a usage error."""
    (repo / ".services").mkdir()
    (repo / ".services" / "kafka.brokers").write_text("1\n")
    result = run(repo, "kafka-node", "kill", "2")
    assert result.returncode == 2
    assert "node 2 does not exist: Kafka runs as one broker, node 1" in result.stderr


def _stopped_cluster(repo: Path) -> None:
    """The files of a three-broker cluster whose nodes do not run (and were never formatted)."""
    state = repo / ".services"
    for node, port in ((1, 41000), (2, 41003), (3, 41006)):
        node_dir = state / "kafka-cluster" / f"node-{node}"
        node_dir.mkdir(parents=True)
        (node_dir / "server.properties").write_text(
            f"node.id={node}\n"
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{port + 1},"
            f"SASL_SSL://127.0.0.1:{port + 2}\n"
        )
    (state / "kafka.brokers").write_text("3\n")


def test_kafka_node_reports_nodes_that_do_not_run(repo: Path) -> None:
    """status lists each node down with its client port (exit 1); port reads it from the
    node's server.properties; pid and kill fail; stop of a stopped node is fine; start
    needs the node's formatted storage."""
    _stopped_cluster(repo)
    status = run(repo, "kafka-node", "status")
    assert status.returncode == 1
    assert status.stdout.split("\n")[:3] == [
        "node 1  down  127.0.0.1:41000",
        "node 2  down  127.0.0.1:41003",
        "node 3  down  127.0.0.1:41006",
    ]
    port = run(repo, "kafka-node", "port", "3")
    assert (port.returncode, port.stdout) == (0, "41006\n")
    pid = run(repo, "kafka-node", "pid", "2")
    assert pid.returncode == 1
    assert "node 2 is not running" in pid.stderr
    kill = run(repo, "kafka-node", "kill", "2")
    assert kill.returncode == 1
    assert "node 2 is not running (nothing killed)" in kill.stderr
    stop = run(repo, "kafka-node", "stop", "2")
    assert (stop.returncode, stop.stdout) == (0, "services/kafka-node: node 2 was not running\n")
    start = run(repo, "kafka-node", "start", "2")
    assert start.returncode == 1
    assert "node 2 has no formatted storage" in start.stderr


def _nodes_bash(repo: Path, call: str, *args: str) -> subprocess.CompletedProcess[str]:
    """One function of services/kafka/nodes.bash, sourced as the scripts do."""
    script = f'. services/kafka/nodes.bash && {call} "$@"'
    return subprocess.run(
        ["bash", "-c", script, "nodes", *args],
        cwd=repo,
        env={
            **os.environ,
            "STATE": str(repo / ".services"),
            "SERVICES_SRC": str(repo / "services"),
        },
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


class _FakeBroker:
    """Answers one Metadata request on a local port as a broker listing ``brokers`` would,
    and keeps the request it got."""

    def __init__(self, brokers: int) -> None:
        self.brokers = brokers
        self.request = b""
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            size = struct.unpack(">i", conn.recv(4, socket.MSG_WAITALL))[0]
            self.request = conn.recv(size, socket.MSG_WAITALL)
            correlation_id = self.request[4:8]
            # Metadata v4: throttle time, then the brokers (id, host, port, rack).
            body = struct.pack(">i", 0) + struct.pack(">i", self.brokers)
            for node in range(1, self.brokers + 1):
                body += struct.pack(">ih9sih", node, 9, b"127.0.0.1", 39000 + node, -1)
            reply = correlation_id + body
            conn.sendall(struct.pack(">i", len(reply)) + reply)


@pytest.fixture
def fake_broker() -> Iterator[_FakeBroker]:
    broker = _FakeBroker(3)
    yield broker
    broker.server.close()


def test_the_metadata_probe_reads_how_many_brokers_the_cluster_has(
    repo: Path, fake_broker: _FakeBroker
) -> None:
    """broker_count sends a Metadata v4 request for no topics and prints the number of
    brokers in the reply."""
    result = _nodes_bash(repo, "broker_count", str(fake_broker.port))
    assert (result.returncode, result.stdout) == (0, "3\n"), result.stderr
    fake_broker.thread.join(timeout=10)
    api_key, version = struct.unpack(">hh", fake_broker.request[:4])
    assert (api_key, version) == (3, 4)
    assert fake_broker.request.endswith(b"outbox-probe" + struct.pack(">ib", 0, 0))


def test_the_metadata_probe_fails_where_nothing_listens(repo: Path) -> None:
    """broker_count fails (and prints nothing) when no broker answers."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    result = _nodes_bash(repo, "broker_count", str(port))
    assert result.returncode != 0
    assert result.stdout == ""


def test_make_services_passes_the_broker_count_through() -> None:
    """`make services KAFKA_BROKERS=3` runs services/up with OUTBOX_KAFKA_BROKERS=3; without
    it, services/up runs as before."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")

    def recipe(*args: str) -> str:
        # As a top-level make would run it: under `make test`, the inherited
        # MAKEFLAGS and MAKELEVEL make it print the directories it enters.
        env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MAKELEVEL", "MFLAGS"}}
        done = subprocess.run(
            [make, "--no-print-directory", "-n", "services", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return done.stdout.strip()

    assert recipe("KAFKA_BROKERS=3") == "OUTBOX_KAFKA_BROKERS=3 services/up"
    assert recipe() == "services/up"


def test_a_port_a_client_connection_holds_is_not_free_for_a_node(repo: Path) -> None:
    """port_bindable fails for a port a listener or an outgoing connection holds (as when a
    client gets a stopped node's port as its ephemeral port), and passes once it is closed."""
    if shutil.which("python3") is None:
        pytest.skip("port_bindable assumes a free port without python3")
    with socket.create_server(("127.0.0.1", 0)) as server:
        listening = server.getsockname()[1]
        assert _nodes_bash(repo, "port_bindable", str(listening)).returncode == 1
        client = socket.socket()
        client.bind(("127.0.0.1", 0))
        held = client.getsockname()[1]
        client.connect(("127.0.0.1", listening))
        accepted, _ = server.accept()
        with client, accepted:
            assert _nodes_bash(repo, "port_bindable", str(held)).returncode == 1
    with socket.create_server(("127.0.0.1", 0)) as server:
        closed = server.getsockname()[1]
    assert _nodes_bash(repo, "port_bindable", str(closed)).returncode == 0


def test_a_start_that_failed_to_bind_is_told_from_other_failures(
    repo: Path, tmp_path: Path
) -> None:
    """bind_conflict prints the port Kafka could not listen on, and fails for a log
    without that error."""
    log = tmp_path / "broker.log"
    log.write_text(
        "[2026-12-01 16:55:51,128] ERROR Unable to start acceptor for PLAINTEXT\n"
        "org.apache.kafka.common.KafkaException: Socket server failed to bind to "
        "127.0.0.1:39492: Address already in use.\n"
    )
    found = _nodes_bash(repo, "bind_conflict", str(log))
    assert (found.returncode, found.stdout) == (0, "39492\n")
    log.write_text("[2026-12-01 16:55:51,128] ERROR Exiting Kafka due to fatal exception\n")
    assert _nodes_bash(repo, "bind_conflict", str(log)).returncode == 1

"""A partition leader that moves between live brokers, on a real three-broker cluster.

Production clusters move leaders all the time: a broker restarts, then the
controller hands its partitions back (preferred leader election). A client
that keeps the old leader in its metadata is answered NOT_LEADER by a broker
that is alive and well.

The cluster is ``OUTBOX_KAFKA_CLUSTER_BOOTSTRAP`` when set (three brokers or
more), or the services' own Kafka when it has three brokers or more
(``services/up`` with ``OUTBOX_KAFKA_BROKERS=3``). Otherwise, when the single broker is
this checkout's ``services/up``, the module starts a cluster of its own with
a copy of the ``services/`` scripts in a temporary directory (its ports
``OUTBOX_KAFKA_PORT`` + 200 to + 207, or the first hundred above with all of
them free; its data apart from the checkout's), and stops it at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, TopicPartition
from kafka.errors import KafkaError

from outbox.intent import ID_HEADER
from publisher.scanner import KafkaLogScanner
from tests.conftest import Services
from tests.support import (
    SERVICES,
    create_topic,
    local_services_running,
    send_raw,
    wait_until,
)

#: How far above the single broker's port the module's own cluster may listen, tried
#: in order: its ports are in Linux's ephemeral range, so a connection of this run may
#: hold one of them as its local port (services/up then waits for it in vain).
CLUSTER_PORT_OFFSETS = range(200, 1100, 100)
#: The ports a cluster of three takes above its first (services/up: node N listens at
#: +3(N-1), its controller one above).
CLUSTER_PORTS = (0, 1, 3, 4, 6, 7)


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_port(single_port: int) -> int:
    """The first port of the first offset at which every port of the cluster is free."""
    for offset in CLUSTER_PORT_OFFSETS:
        first = single_port + offset
        if all(_bindable(first + p) for p in CLUSTER_PORTS):
            return first
    raise RuntimeError(
        f"no free ports for a cluster of three {CLUSTER_PORT_OFFSETS.start}-"
        f"{CLUSTER_PORT_OFFSETS.stop} above {single_port}"
    )


def _own_cluster(tmp: Path, single_bootstrap: str) -> tuple[str, dict[str, str]]:
    """Start three brokers from a copy of services/ under ``tmp``; their bootstrap and
    the environment that stops them."""
    shutil.copytree(SERVICES, tmp / "services", symlinks=True)
    jars = SERVICES.parent / ".services" / "kafka" / "lib"
    if jars.is_dir():  # the checkout's broker jars: no Maven run
        (tmp / ".services" / "kafka").mkdir(parents=True)
        (tmp / ".services" / "kafka" / "lib").symlink_to(jars)
    port = _cluster_port(int(single_bootstrap.split(",", maxsplit=1)[0].rsplit(":", 1)[1]))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"OUTBOX_DATABASE_URL", "OUTBOX_KAFKA_BOOTSTRAP"}
    }
    env |= {
        "OUTBOX_KAFKA_BROKERS": "3",
        "OUTBOX_KAFKA_PORT": str(port),
        "OUTBOX_KAFKA_CONTROLLER_PORT": str(port + 1),
        "OUTBOX_KAFKA_SASL_PORT": "0",
    }
    try:
        up = subprocess.run(
            [str(tmp / "services" / "up"), "kafka"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if up.returncode != 0:
            raise RuntimeError(f"services/up of the test cluster failed:\n{up.stdout}\n{up.stderr}")
    except BaseException:
        _stop_cluster(tmp, env)  # up leaves the nodes it started running
        raise
    return ",".join(f"127.0.0.1:{port + 3 * n}" for n in range(3)), env


def _brokers(bootstrap: str) -> int:
    """How many brokers the cluster at ``bootstrap`` has (0 if it cannot be asked)."""
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    except KafkaError:
        return 0
    try:
        return len(admin.describe_cluster()["brokers"])
    except KafkaError:
        return 0
    finally:
        admin.close()


def _stop_cluster(tmp: Path, env: dict[str, str]) -> None:
    subprocess.run(
        [str(tmp / "services" / "down"), "--purge"],  # no PostgreSQL runs there
        env=env,
        capture_output=True,
        timeout=180,
        check=False,
    )


@dataclass(frozen=True)
class Cluster:
    """A Kafka cluster of three brokers or more."""

    bootstrap: str
    #: ``services/kafka-node`` with its environment, for the module's own
    #: cluster (``None`` for a given one, whose brokers the tests may not kill).
    node_script: tuple[Path, dict[str, str]] | None = None

    def node(self, command: str, node_id: int) -> None:
        assert self.node_script is not None
        script, env = self.node_script
        subprocess.run(
            [str(script), command, str(node_id)], env=env, check=True, capture_output=True
        )


@pytest.fixture(scope="module")
def cluster(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster of three brokers or more."""
    given = os.environ.get("OUTBOX_KAFKA_CLUSTER_BOOTSTRAP")
    if given:
        yield Cluster(given)
        return
    if _brokers(services.kafka_bootstrap) >= 3:
        # The services are a cluster already (services/up with OUTBOX_KAFKA_BROKERS=3).
        yield Cluster(services.kafka_bootstrap)
        return
    if not local_services_running():
        pytest.skip("needs OUTBOX_KAFKA_CLUSTER_BOOTSTRAP, or the services services/up runs")
    tmp = tmp_path_factory.mktemp("cluster")
    bootstrap, env = _own_cluster(tmp, services.kafka_bootstrap)
    try:
        yield Cluster(bootstrap, (tmp / "services" / "kafka-node", env))
    finally:
        _stop_cluster(tmp, env)


def _leader(admin: KafkaAdminClient, topic: str) -> tuple[int, list[int]]:
    (described,) = admin.describe_topics([topic])
    (partition,) = described["partitions"]
    return partition["leader_id"], list(partition["replica_nodes"])


def _move_leader(admin: KafkaAdminClient, topic: str, to: int | None = None) -> int:
    """Make another in-sync replica (``to``, if given) the partition's leader; its id."""
    leader, replicas = _leader(admin, topic)
    assert len(replicas) >= 2, f"{topic}[0] has one replica: its leader cannot move"
    if to is None:
        to = next(r for r in replicas if r != leader)
    assert to != leader, f"broker {to} leads {topic}[0] already"
    order = [to] + [r for r in replicas if r != to]
    admin.alter_partition_reassignments({TopicPartition(topic, 0): order})

    def moved() -> bool:
        admin.elect_leaders(0, {topic: [0]}, raise_errors=False)  # 0: preferred
        return _leader(admin, topic)[0] == order[0]

    wait_until(moved, timeout=60, interval=0.5, what=f"{topic}[0]'s leader to move")
    return order[0]


def _produce(bootstrap: str, topic: str, count: int) -> list[str]:
    """``count`` records of key ``k`` carrying message ids, to partition 0; their ids."""
    ids = [str(uuid.uuid4()) for _ in range(count)]
    send_raw(bootstrap, topic, 0, [(b"k", [(ID_HEADER, i.encode())]) for i in ids])
    return ids


def test_offsets_are_found_at_once_after_the_partition_leader_moved(cluster: Cluster) -> None:
    # The reconciler asks a partition's offsets before each scan. After a
    # leader moved, kafka-python's consumer kept asking the old leader (which
    # answers NOT_LEADER) without looking the new one up, until its metadata
    # expired five minutes later: uncertain messages waited that long.
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(cluster.bootstrap, topic, partitions=1, replication_factor=3)
    _produce(cluster.bootstrap, topic, 10)
    scanner = KafkaLogScanner(cluster.bootstrap, timeout_seconds=30)
    admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap, client_id="outbox-tests")
    try:
        assert scanner.offset_range(topic, 0) == (0, 10)
        assert scanner.offset_range(topic, 0, committed=True) == (0, 10)

        _move_leader(admin, topic)
        later = _produce(cluster.bootstrap, topic, 5)

        for committed in (False, True):
            began = time.monotonic()
            assert scanner.offset_range(topic, 0, committed=committed) == (0, 15)
            took = time.monotonic() - began
            assert took < 5, f"committed={committed}: {took:.1f} s"
        # The scan itself (the consumer's fetches) follows the new leader too.
        scan = scanner.find(topic, 0, 0, 15, [later[2]], keys=[b"k"])
        assert scan.found == {later[2]: [12]}
        assert scan.key_records == {b"k": 15}
    finally:
        scanner.close()
        admin.close()


def test_a_leader_on_a_broker_that_was_down_when_the_scanner_started_is_found(
    cluster: Cluster,
) -> None:
    # The admin client looks the leader up afresh but connects through its
    # list of brokers, refreshed every five minutes: one that was down then
    # and leads now is unknown to it (UnknownBrokerIdError until the refresh).
    if cluster.node_script is None:
        pytest.skip("kills a broker: only of the module's own cluster")
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(cluster.bootstrap, topic, partitions=1, replication_factor=3)
    _produce(cluster.bootstrap, topic, 4)
    admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap, client_id="outbox-tests")
    leader, _ = _leader(admin, topic)
    away = next(n for n in (1, 2, 3) if n != leader)
    cluster.node("kill", away)
    scanner = KafkaLogScanner(cluster.bootstrap)
    try:
        # The scanner starts while the broker is away (once the cluster has
        # dropped it from its metadata).
        def gone() -> bool:
            try:
                brokers = admin.describe_cluster()["brokers"]
            except KafkaError:  # asked the broker that was killed
                return False
            # A fenced broker is left out of the metadata clients get.
            return away not in {b["broker_id"] for b in brokers if not b.get("is_fenced")}

        wait_until(gone, timeout=60, interval=0.5, what=f"broker {away} to leave the metadata")
        assert scanner.offset_range(topic, 0) == (0, 4)
        cluster.node("start", away)

        def in_sync() -> bool:
            (described,) = admin.describe_topics([topic])
            return away in described["partitions"][0]["isr_nodes"]

        wait_until(in_sync, timeout=60, interval=0.5, what=f"broker {away} back in sync")
        _move_leader(admin, topic, to=away)

        assert scanner.offset_range(topic, 0) == (0, 4)
        assert scanner.offset_range(topic, 0, committed=True) == (0, 4)
    finally:
        cluster.node("start", away)  # a no-op once it runs
        scanner.close()
        admin.close()

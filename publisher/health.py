"""Whether the publisher is alive and whether it is ready, from what it last saw.

``Health`` is written to by the loop, the heartbeat and the Kafka probe as
they work, and read by ``/healthz``, ``/readyz`` and the metrics. It never
contacts anything itself, so answering a probe costs nothing and cannot
hang:

* alive (``/healthz``): the loop has not ended and has turned within
  ``alive_seconds`` (a settle may retry through a database outage for a
  whole lease, so this is longer than the readiness limit), and no
  background thread was ended by an error;
* ready (``/readyz``): the publisher is registered, its last database
  contact and its last Kafka contact succeeded, its writes to Kafka have not
  been failing for a lease (``Health.writes_failing``: brokers that answer
  the probe's questions are not brokers that take its records), it is not
  stopping, and the loop turned within ``stall_seconds``.

Each check answers ``ok`` or a short code from ``CODES``, never an error's
text: the endpoints are served without authentication, and what psycopg or
Kafka say on failure names hosts, ports, users and databases. The details
go to the log, where whoever runs the publisher reads them.

An idle publisher sends nothing to Kafka, so ``KafkaProbe`` asks the broker
for its cluster description whenever nothing else talked to Kafka for a
while: a broker that went away is noticed without traffic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaAdminClient
from kafka import errors as kafka_errors

from publisher.kafka_security import PLAINTEXT, KafkaSecurity
from publisher.outcomes import refuses_publisher
from publisher.service import BackgroundService

log = logging.getLogger(__name__)

Clock = Callable[[], float]


#: Every code a check of ``/healthz`` or ``/readyz`` may answer besides ``ok``.
CODES = (
    "not_registered",  # the publisher has not registered in outbox.publishers yet
    "database_not_contacted",  # no database contact yet (starting)
    "database_unavailable",  # the last database contact failed
    "kafka_not_contacted",  # no Kafka contact yet (starting)
    "kafka_unavailable",  # the last Kafka contact failed
    "kafka_refused",  # the broker refuses this publisher itself (an ACL, its login)
    "kafka_writes_failing",  # the broker answers, but no write went through for a lease
    "starting",  # the loop has not started yet
    "stopping",  # a stop was requested; the batch in hand is being finished
    "loop_stalled",  # the loop has not turned within its limit
    "loop_ended",  # the loop has ended; the process is about to exit
)


class Contact:
    """The last contact with one dependency: whether it succeeded, and when.

    What a failure said is not kept here: the caller logs it, and the
    readiness check reports only ``<name>_unavailable``.
    """

    def __init__(self, name: str, clock: Clock, wall: Clock) -> None:
        self.name = name
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        #: ``None`` until the first contact.
        self.ok: bool | None = None
        #: The class of the last failure (``OperationalError``), for debugging; never served.
        self.error_type: str | None = None
        #: Monotonic time of the last contact, either way.
        self.last_at: float | None = None
        #: Wall-clock time (epoch seconds) of the last successful contact.
        self.last_success_time: float | None = None
        #: Monotonic time of the first failure since the last success (None: none).
        self._failing_since: float | None = None
        #: Whether more than the probe's questions failed in that run (for Kafka: a
        #: write); a run of unanswered questions alone ends at the next answer.
        self._serving_failed = False

    def succeeded(self) -> None:
        """The dependency answered."""
        self._reached(served=True)

    def _reached(self, *, served: bool) -> None:
        """The dependency answered; ``served``: it did what was asked of it, which ends
        a run of failures (``failing_for``). An answer alone ends only a run in which
        nothing but questions went unanswered."""
        with self._lock:
            self.ok, self.error_type = True, None
            self.last_at = self._clock()
            self.last_success_time = self._wall()
            if served or not self._serving_failed:
                self._failing_since, self._serving_failed = None, False

    def failed(self, error: BaseException | str) -> None:
        """The dependency did not answer (or answered that it cannot serve).

        ``error`` is the exception, or a description of the failure; only an
        exception's class name is kept.
        """
        self._fail(error, serving=True)

    def unanswered(self, error: BaseException) -> None:
        """A question of the probe's went unanswered: as ``failed``, but an answer to the
        next one ends the run (``failing_for``), unless something else failed in it
        too. An idle publisher that lost its broker for a moment writes nothing that
        could end the run."""
        self._fail(error, serving=False)

    def _fail(self, error: BaseException | str, *, serving: bool) -> None:
        kind = None if isinstance(error, str) else type(error).__name__
        with self._lock:
            self.ok, self.error_type = False, kind
            self.last_at = self._clock()
            if self._failing_since is None:
                self._failing_since = self.last_at
            self._serving_failed = self._serving_failed or serving

    def answered(self) -> None:
        """The dependency answered a question of the probe's (see ``KafkaContact``)."""
        self.succeeded()

    def failing_for(self) -> float | None:
        """Seconds since the first failure after the last success (for Kafka: the last
        write it let through, see ``KafkaContact``); ``None`` when none failed since."""
        with self._lock:
            since = self._failing_since
        return None if since is None else self._clock() - since

    def age(self) -> float | None:
        """Seconds since the last contact, either way; ``None`` if never."""
        last = self.last_at
        return None if last is None else self._clock() - last

    def problem(self) -> str | None:
        """The code of why this dependency does not count as reachable; ``None`` if it does."""
        with self._lock:
            ok, last = self.ok, self.last_at
        if ok is None or last is None:
            return f"{self.name}_not_contacted"
        if not ok:
            return f"{self.name}_unavailable"
        return None


class KafkaContact(Contact):
    """Kafka's contact, which also remembers that the broker refused this publisher itself
    (``refuses_publisher``: an ACL on its TransactionalIds or the cluster, its login).

    The broker is up, and ``ok`` (``outbox_kafka_up``) says so, but the
    publisher cannot deliver until someone grants what is missing: readiness
    says ``kafka_refused``. The probe's cluster description, topic lookups
    and the reconciler's reads (``answered``) say that the broker is there,
    not that it lets this publisher write: only a Kafka transaction that
    begins or a record the broker confirms (``succeeded``) lifts the refusal.
    The refused batch's messages wait out a backoff and are tried again, so
    a grant is noticed at the next try.
    """

    def __init__(self, clock: Clock, wall: Clock) -> None:
        super().__init__("kafka", clock, wall)
        self.refused = False

    def succeeded(self) -> None:
        """The broker answered the publisher: whatever it refused before, it lets it now."""
        super().succeeded()
        self.refused = False

    def _fail(self, error: BaseException | str, *, serving: bool) -> None:
        """As ``Contact._fail``; a refusal of the publisher itself is kept until a
        ``succeeded``."""
        super()._fail(error, serving=serving)
        if not isinstance(error, str) and refuses_publisher(error):
            self.refused = True

    def answered(self) -> None:
        """The broker answered a question anyone may ask: it is up; a refusal stays, and
        so does a run of failed writes (``failing_for``): a host that reaches a broker
        may still not reach the partitions' leaders, or be let write."""
        self._reached(served=False)

    def problem(self) -> str | None:
        """``kafka_refused`` while the broker refuses the publisher, else as any contact."""
        return "kafka_refused" if self.refused else super().problem()


@dataclass(frozen=True)
class Verdict:
    """An answer of ``/healthz`` or ``/readyz``: the result and each check's finding."""

    ok: bool
    #: Check name -> ``"ok"`` or the code of why it fails (one of ``CODES``).
    checks: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The JSON body: ``{"ok": ..., "checks": {...}}`` plus the names that fail."""
        failing = [name for name, finding in self.checks.items() if finding != "ok"]
        return {"ok": self.ok, "failing": failing, "checks": self.checks}


class Health:
    """What the publisher last saw of itself and its dependencies."""

    def __init__(
        self,
        *,
        stall_seconds: float,
        alive_seconds: float,
        lease_seconds: float | None = None,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self.stall_seconds = stall_seconds
        self.alive_seconds = alive_seconds
        #: How long writes to Kafka may fail before the publisher is not ready
        #: (``writes_failing``); ``None``: however long.
        self.lease_seconds = lease_seconds
        #: Whether the publisher has something to write: set when a claim finds a batch,
        #: cleared once nothing will need it (not while it has stepped back, and claims
        #: nothing for want of lanes). An idle one's writes are not failing, however
        #: long ago the last one failed.
        self.writes_wanted = True
        self._clock = clock
        self._wall = wall
        self.database = Contact("database", clock, wall)
        self.kafka = KafkaContact(clock, wall)
        self.registered = False
        self.stopping = False
        #: ``starting`` -> ``running`` -> ``ended``.
        self.loop = "starting"
        #: The background threads the publisher relies on (the heartbeat, ...):
        #: one that an unexpected error ended fails readiness.
        self.threads: list[BackgroundService] = []
        self._turned_at: float | None = None
        self.last_turn_time: float | None = None

    def loop_started(self) -> None:
        """The loop runs from now on."""
        self.loop = "running"
        self.loop_turned()

    def loop_turned(self) -> None:
        """The loop went once round (or moved a batch on): it is not stuck."""
        self._turned_at = self._clock()
        self.last_turn_time = self._wall()

    def loop_ended(self) -> None:
        """The loop has ended; the process is about to exit."""
        self.loop = "ended"

    def _loop_problem(self, limit: float) -> str | None:
        if self.loop == "ended":
            return "loop_ended"
        if self.loop == "starting" or self._turned_at is None:
            return None
        if self._clock() - self._turned_at > limit:
            return "loop_stalled"
        return None

    def loop_stuck(self) -> bool:
        """Whether the running loop has not turned for ``stall_seconds``."""
        return self._loop_problem(self.stall_seconds) is not None and self.loop == "running"

    def writes_failing_for(self) -> float | None:
        """Seconds this publisher's writes to Kafka have been failing, none going through
        (``KafkaContact.failing_for``), while it has something to write
        (``writes_wanted``); ``None`` when they are not."""
        return self.kafka.failing_for() if self.writes_wanted else None

    def writes_failing(self) -> bool:
        """Whether this publisher's writes to Kafka have failed for a lease
        (``writes_failing_for``): as long as the heartbeat lets them fail before it steps
        the publisher back, when another publisher reaches Kafka (``publisher.heartbeat``).
        Not ready then, whether another one does or not: the brokers may answer the probe
        all along."""
        failing, limit = self.writes_failing_for(), self.lease_seconds
        return failing is not None and limit is not None and failing >= limit

    def liveness(self) -> Verdict:
        """Whether the process and its loop are alive (a starting loop counts as alive), and
        no background thread it relies on was ended by an error: without its heartbeat a
        publisher's lanes lapse while its loop turns, and only a restart brings it back."""
        problem = self._loop_problem(self.alive_seconds)
        checks = {"loop": problem or "ok"}
        if self.thread_died():
            checks["threads"] = "thread_died"
        return Verdict(all(v == "ok" for v in checks.values()), checks)

    def thread_died(self) -> bool:
        """Whether a background thread the publisher relies on was ended by an error."""
        return any(t.died is not None for t in self.threads)

    def readiness(self) -> Verdict:
        """Whether the publisher can do its work now; each failing check gives its code."""
        checks = {
            "registered": "ok" if self.registered else "not_registered",
            "database": self.database.problem() or "ok",
            "kafka": self.kafka.problem()
            or ("kafka_writes_failing" if self.writes_failing() else "ok"),
        }
        if self.stopping:
            checks["loop"] = "stopping"
        elif self.loop == "starting":
            checks["loop"] = "starting"
        else:
            checks["loop"] = self._loop_problem(self.stall_seconds) or "ok"
        if self.thread_died():
            checks["threads"] = "thread_died"
        return Verdict(all(v == "ok" for v in checks.values()), checks)


class KafkaProbe(BackgroundService):
    """Checks Kafka in a daemon thread when nothing else talked to it for ``interval`` seconds.

    It probes once at start, then every interval; ``stop()`` waits up to 15 s
    for a probe in progress.
    """

    def __init__(self, contact: Contact, check: Callable[[], None], *, interval: float) -> None:
        super().__init__(
            name="outbox-kafka-probe", interval=interval, run_at_start=True, join_timeout=15
        )
        self._contact = contact
        self._check = check

    def run_once(self) -> bool:
        """Probe unless a recent contact already answered the question; say whether it probed."""
        age = self._contact.age()
        if age is not None and age < self.interval:
            return False
        try:
            self._check()
        except Exception as exc:  # noqa: BLE001 - any failure means Kafka is not reachable
            if self._contact.ok is not False:
                log.warning("Kafka is not reachable: %s: %s", type(exc).__name__, exc)
            self._contact.unanswered(exc)
        else:
            self._contact.answered()
        return True


class KafkaClusterCheck:
    """A cheap question to the broker (describe the cluster), on an admin client kept open."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        timeout_ms: int = 5_000,
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        self._bootstrap = bootstrap_servers
        self._timeout_ms = timeout_ms
        self._security = security
        self._admin: Any = None

    def __call__(self) -> None:
        """Return if the broker answered; raise otherwise."""
        try:
            if self._admin is None:
                self._admin = KafkaAdminClient(
                    bootstrap_servers=self._bootstrap,
                    client_id="outbox-publisher-probe",
                    request_timeout_ms=self._timeout_ms,
                    bootstrap_timeout_ms=self._timeout_ms,
                    **self._security.kafka_python(),
                )
            self._admin.describe_cluster()
        except kafka_errors.ClusterAuthorizationFailedError:
            return  # the broker answered; it only keeps the details to itself
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Close the admin client (the next check opens another)."""
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                admin.close()
            except Exception as exc:  # noqa: BLE001 - closing a broken client may fail too
                log.debug("closing the Kafka probe's client: %s", exc)

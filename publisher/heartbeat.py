"""The publisher's heartbeat: proof of life, lease renewal, and its share of lanes.

A background thread, on a connection of its own, updates
``outbox.publishers.heartbeat_at`` every interval, renews the message leases
this publisher holds that would expire within half a lease, and keeps its
fair share of lanes (``publisher.lanes``), which it also rebalances every
second between beats. It renews message leases only
while the publisher loop reports progress: a loop that is stuck must lose its
leases, so that recovery can move its messages on. A loop that has stopped
turning altogether (``loop_alive``) gets no heartbeat at all: the publisher
no longer counts as live, its lanes are not renewed, and when they expire
the other publishers share them, so the keys of those lanes do not wait for
a restart. It beats again as soon as the loop turns again. Each beat also tells the
publisher's health whether the database answered, so an idle publisher
still notices a database that went away.

A publisher that turns but cannot deliver to Kafka (its host cut off from
the brokers or from the partitions' leaders, or refused by them, while the
others deliver) would keep its lanes, and their keys would wait for it.
Each beat says whether it reaches Kafka: the broker answers, lets it in,
and no write has failed since the last one it let through
(``outbox.publishers.kafka_reached_at``). Once its writes have failed for a
lease while another live publisher reaches Kafka, it steps back as a
stalled loop does: no heartbeat, its lanes expire, the others take them.
It comes back when no other publisher reaches Kafka (when Kafka is away for
all, nobody stays back), or, once the brokers answer it again (its idle
probe asks them), after a hold-off that doubles each time it has to step
back again before a write goes through (a lease, then two... up to
``LONGEST_STEP_BACK``): a host that reaches the brokers but cannot write
tries again now and then, not every other lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

import psycopg

from publisher.health import Contact
from publisher.lanes import LaneKeeper
from publisher.service import BackgroundService
from publisher.store import PublisherStore

log = logging.getLogger(__name__)

#: How often lanes are rebalanced between heartbeats.
LANE_TICK_SECONDS = 1.0
#: The longest a publisher that could not deliver to Kafka stays back before it tries
#: again (``Heartbeat._step_back``), while the brokers answer it.
LONGEST_STEP_BACK = 600.0


class Heartbeat(BackgroundService):
    """Runs ``store.heartbeat`` every ``interval`` seconds until stopped.

    Its thread turns every second when it keeps lanes (every ``interval``
    without): each turn beats when a beat is due, and rebalances the lanes
    otherwise. A database error is logged, the heartbeat's connection closed
    and the next turn tries again.
    """

    recoverable = (psycopg.Error,)

    def __init__(
        self,
        store: PublisherStore,
        *,
        interval: float,
        lease_seconds: float,
        progressing: Callable[[], bool],
        lanes: LaneKeeper | None = None,
        database: Contact | None = None,
        held_batches: Callable[[], Collection[int]] | None = None,
        loop_alive: Callable[[], bool] | None = None,
        kafka: Contact | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Lanes are balanced every second between beats, so that a publisher
        # that starts (or stops) moves lanes within a second or two, not a
        # heartbeat interval on each side.
        tick = interval if lanes is None else min(interval, LANE_TICK_SECONDS)
        super().__init__(
            name="outbox-heartbeat", interval=tick, join_timeout=10, failure="heartbeat failed"
        )
        self._store = store
        self._database = database
        self.lanes = lanes
        self._beat_interval = interval
        self._clock = clock
        #: When the next beat is due (``clock``); each beat moves it on.
        self._next_beat = clock() + interval
        self._lease_seconds = lease_seconds
        self._progressing = progressing
        #: The batches whose leases may be renewed (None: every lease held).
        self._held_batches = held_batches
        #: Whether the loop still turns; lanes are kept only while it does.
        self._loop_alive = loop_alive or (lambda: True)
        self._stalled = False
        #: The publisher's contact with Kafka (None: not known, never steps back).
        self._kafka = kafka
        #: Whether it lets its lanes go, Kafka away from it and not from another one.
        self.stepped_back = False
        #: Times it stepped back since a write last went through, when it came back
        #: last, and until when it stays back (``clock``).
        self._backs = 0
        self._came_back_at: float | None = None
        self._back_until = 0.0

    def beat(self) -> int:
        """One heartbeat now; returns how many leases were renewed."""
        self._next_beat = self._clock() + self._beat_interval
        if not self._still_working():
            return 0
        batches = None if self._held_batches is None else self._held_batches()
        renewed = self._store.heartbeat(
            self._lease_seconds,
            renew=self._progressing(),
            batches=batches,
            kafka_reached=None if self._kafka is None else self._reaches_kafka(),
        )
        if renewed:
            log.debug("renewed %d leases", renewed)
        self._balance_lanes()
        return renewed

    def _balance_lanes(self) -> None:
        """Keep a fair share of lanes while the loop turns (and no stop was asked for)."""
        if self.lanes is not None and not self.stopping and self._still_working():
            self.lanes.balance()

    def _reaches_kafka(self) -> bool:
        """Whether the broker answers this publisher, lets it in, and has let through its
        every write since the last that failed (see ``KafkaContact``)."""
        kafka = self._kafka
        return kafka is not None and kafka.problem() is None and kafka.failing_for() is None

    def _step_back(self) -> None:
        """Step back (``stepped_back``) once this publisher's writes to Kafka have failed
        for a lease (since it came back, if it did) while another live publisher reaches
        Kafka; come back when none does, or when the brokers answer it again after the
        hold-off. Says so in the log when that changes."""
        kafka = self._kafka
        if kafka is None:
            return
        now = self._clock()
        failing = kafka.failing_for()
        if failing is None:
            self._backs = 0  # a write went through: the next hold-off starts short again
        if not self.stepped_back:
            trying = failing
            if failing is not None and self._came_back_at is not None:
                trying = min(failing, now - self._came_back_at)
            if (
                trying is not None
                and trying >= self._lease_seconds
                and self._store.others_reach_kafka(self._lease_seconds)
            ):
                self._backs += 1
                hold_off = min(self._lease_seconds * 2 ** (self._backs - 1), LONGEST_STEP_BACK)
                self._back_until = now + hold_off
                self.stepped_back = True
                log.warning(
                    "writes to Kafka have failed for %.0fs while another publisher reaches "
                    "Kafka: no more heartbeats, and lanes %s are no longer renewed; the others "
                    "take them over when they expire. Tried again in %.0fs at the earliest",
                    trying,
                    sorted(self.lanes.owned) if self.lanes is not None else [],
                    hold_off,
                )
            return
        why = None
        if failing is None:
            why = "a write to Kafka went through"
        elif not self._store.others_reach_kafka(self._lease_seconds):
            why = "no other publisher reaches Kafka"
        elif now >= self._back_until and kafka.ok is True:
            why = "the brokers answer again: trying to deliver"
        if why is not None:
            log.warning("%s: heartbeats and lanes resume", why)
            self.stepped_back = False
            self._came_back_at = now

    def _still_working(self) -> bool:
        """Whether the loop turns (and has not stepped back: ``_step_back``); says so in
        the log when the loop stops or turns again."""
        if self.stepped_back:
            return False
        if self._loop_alive():
            if self._stalled:
                log.warning("the loop turns again: heartbeats and lanes resume")
                self._stalled = False
            return True
        if not self._stalled:
            self._stalled = True
            log.error(
                "the loop has stopped turning: no more heartbeats, and lanes %s are no "
                "longer renewed; the other publishers take them over when they expire",
                sorted(self.lanes.owned) if self.lanes is not None else [],
            )
        return False

    def run_once(self) -> None:
        """One turn: a beat if one is due (within half a turn), else a lane rebalance."""
        # While the loop is stuck neither asks the database anything: no contact
        # to report then, and the health shows the stall, not a live database.
        self._step_back()
        working = self._still_working()
        if self._clock() >= self._next_beat - self.interval / 2:
            self.beat()
        else:
            self._balance_lanes()
        if working and self._database is not None:
            self._database.succeeded()

    def stop(self, timeout: float | None = None, *, give_lanes_back: bool = True) -> None:
        """Stop beating, give the lanes back (unless told not to: a publisher that was
        never registered holds none), and close the heartbeat's connection.

        A turn still running after the timeout (its statement hangs) keeps the
        connection: the lanes are not given back on it from here, where they
        would race that turn; they expire with their leases instead.
        """
        super().stop(timeout)
        if self.running:
            log.warning(
                "the heartbeat's turn is still running: lanes %s are not given back; "
                "the other publishers take them over when their leases expire",
                sorted(self.lanes.owned) if self.lanes is not None else [],
            )
            return
        if self.lanes is not None and give_lanes_back:
            try:
                self.lanes.release_all()
            except psycopg.Error as exc:
                log.warning("could not give the lanes back (they expire on their own): %s", exc)
        self._store.close()

    def _failed(self, exc: Exception) -> None:
        super()._failed(exc)
        if self._database is not None and isinstance(exc, psycopg.OperationalError):
            self._database.failed(exc)
        self._store.close()

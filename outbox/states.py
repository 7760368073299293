"""The states a message moves through (see docs/design.md for the transitions)."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """A message's state, as stored in ``outbox.messages.state``."""

    #: Committed intent, not owned by any publisher; claimable from ``available_at``.
    PENDING = "pending"
    #: Named by an open batch, owned by its publisher under the batch's lease
    #: (derived: the message row says ``pending``; see ``outbox.message_status``).
    IN_FLIGHT = "in_flight"
    #: The broker acknowledged it; ``kafka_partition`` and ``kafka_offset`` say where it is.
    DELIVERED = "delivered"
    #: A send may have reached the broker but no confirmation was stored; never resent blindly.
    UNCERTAIN = "uncertain"
    #: Cannot be delivered as it is (the broker refused it); waits for an operator.
    QUARANTINED = "quarantined"
    #: An operator decided it will not be delivered.
    DISCARDED = "discarded"


#: States a message can still leave: it is not finished.
OPEN_STATES = (State.PENDING, State.IN_FLIGHT, State.UNCERTAIN, State.QUARANTINED)

#: How the note begins that an uncertain message carries (in ``last_error``) while its
#: reconciliation waits on Kafka: the reconciler writes it, and ``outbox inspect``, the
#: views ``outbox.status`` and ``outbox.held_keys`` (schema/0014) tell it by this prefix.
WAITING_NOTE = "reconciliation waits: "

#: How the reason begins that the reconciler escalates an uncertain message with when it
#: proved its record absent but later messages of its key are in Kafka: sending it now
#: would put it after them, and ``outbox inspect`` offers ``--pending`` or ``--discard``.
OVERTAKEN_NOTE = "proven absent, but later messages of its key are in Kafka: "

#: Seconds after an uncertain message's write deadline before its record's
#: absence from Kafka counts as proof: the publisher's default
#: ``--absence-grace``, and how long after the deadline an operator's
#: ``resolve --pending`` waits. A record the partition leader wrote is
#: invisible to a reader (above the high watermark) until every in-sync
#: follower has copied it or been dropped from the ISR. A leader drops a
#: follower that has not caught up for ``replica.lag.time.max.ms`` (Kafka's
#: default 30 s), but looks for such followers only every half of that, and
#: then waits for the controller to accept the smaller ISR: up to 1.5 times it
#: (45 s) and a round trip. 60 s covers that with a margin.
ABSENCE_GRACE_SECONDS = 60.0

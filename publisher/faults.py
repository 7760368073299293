"""Fault injection for the crash and pause tests, off unless ``OUTBOX_ENABLE_FAULTS=1``.

``OUTBOX_CRASH_AT=<cut>[:<n>]`` makes the publisher exit at once with
``os._exit`` when it reaches ``cut`` for the ``n``-th batch (default: the
first); ``OUTBOX_PAUSE_AT`` does the same with ``SIGSTOP``, freezing the whole
process until someone sends ``SIGCONT``. The cuts are the points of the crash
timeline in docs/guarantees.md:

* ``after_claim``: the batch is leased, sending has not begun;
* ``after_send``: every record was handed to the producer, none acknowledged;
* ``after_ack``: the broker acknowledged the batch, nothing recorded yet (in
  transactional delivery: its transaction is not committed yet);
* ``after_commit``: (transactional delivery) the transaction is committed,
  nothing recorded yet;
* ``after_confirm``: the outcomes are recorded.

Both switches take effect only when ``OUTBOX_ENABLE_FAULTS=1`` is set too, so
that a variable left in a production environment (copied from a test setup,
say) cannot make a publisher crash or freeze itself. Without the gate their
values are not even read: the publisher logs one warning naming the
variables that are set, and runs normally.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox.errors import OutboxError

log = logging.getLogger(__name__)

#: The gate: the switches below take effect only when it is exactly ``1``.
ENABLE_VARIABLE = "OUTBOX_ENABLE_FAULTS"
#: The switches, in the order a warning names them.
FAULT_VARIABLES = ("OUTBOX_CRASH_AT", "OUTBOX_PAUSE_AT")

CUTS = ("after_claim", "after_send", "after_ack", "after_commit", "after_confirm")
#: Exit code of an injected crash, so tests can tell it from a real failure.
CRASH_EXIT_CODE = 70


class FaultSpecError(OutboxError):
    """An ``OUTBOX_CRASH_AT`` / ``OUTBOX_PAUSE_AT`` value names no known cut."""


def _parse(variable: str, value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    cut, _, count = value.partition(":")
    if cut not in CUTS or (count and not (count.isdigit() and int(count) >= 1)):
        raise FaultSpecError(
            f"{variable}={value!r}: expected one of {', '.join(CUTS)}, optionally ':N' (N >= 1)"
        )
    return cut, int(count or 1)


@dataclass
class Faults:
    """Where to crash or pause, if anywhere; ``reached`` is called at every cut."""

    crash: tuple[str, int] | None = None
    pause: tuple[str, int] | None = None
    _seen: Counter[str] = field(default_factory=Counter)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Faults:
        """Read ``OUTBOX_CRASH_AT`` and ``OUTBOX_PAUSE_AT`` if ``OUTBOX_ENABLE_FAULTS=1``.

        Without the gate, switches that are set are ignored (their values
        unparsed) and one warning names them; a publisher without faults is
        returned. With it, a value that names no cut raises ``FaultSpecError``.
        """
        if environ.get(ENABLE_VARIABLE) != "1":
            ignored = [name for name in FAULT_VARIABLES if environ.get(name)]
            if ignored:
                log.warning(
                    "%s set but ignored: fault injection is only for tests and needs %s=1 too",
                    " and ".join(ignored),
                    ENABLE_VARIABLE,
                )
            return cls()
        return cls(
            crash=_parse("OUTBOX_CRASH_AT", environ.get("OUTBOX_CRASH_AT")),
            pause=_parse("OUTBOX_PAUSE_AT", environ.get("OUTBOX_PAUSE_AT")),
        )

    def reached(self, cut: str) -> None:
        """Crash or pause here if this is the configured cut and batch."""
        if self.crash is None and self.pause is None:
            return
        self._seen[cut] += 1
        here = (cut, self._seen[cut])
        if here == self.crash:
            sys.stderr.write(f"outbox-publisher: injected crash at {cut} (batch {here[1]})\n")
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
        if here == self.pause:
            sys.stderr.write(f"outbox-publisher: injected pause at {cut} (batch {here[1]})\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)

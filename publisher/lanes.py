"""Sharing the work among publishers: lanes owned under a lease.

Messages fall into a fixed number of lanes (by key, or by id when unkeyed;
see schema/0004_lanes.sql), and a publisher claims only from the lanes it
owns, so one key is never claimed by two publishers at once. ``LaneKeeper``
runs with the heartbeat: it renews this publisher's lanes, takes free or
expired ones up to a fair share (lanes / live publishers, rounded up) and
gives back any above it. A publisher that stops gives all of its lanes back;
one that dies loses them when their lease expires.

Giving a lane back while a batch of it is in flight is safe: the new owner's
claims wait behind the in-flight messages of each key (the claim's hold check).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from publisher.store import PublisherStore

log = logging.getLogger(__name__)


@dataclass
class LaneKeeper:
    """Keeps this publisher's fair share of lanes."""

    store: PublisherStore
    lease_seconds: float
    owned: set[int] = field(default_factory=set)

    def balance(self) -> set[int]:
        """Renew, then take or give back lanes towards a fair share; return the lanes owned."""
        kept, share = self.store.renew_lanes(self.lease_seconds)
        lost = self.owned - kept
        if lost:
            log.warning("lanes %s expired before they were renewed", sorted(lost))
        if len(kept) < share:
            gained = self.store.acquire_lanes(share - len(kept), self.lease_seconds)
            if gained:
                log.info("took lanes %s", sorted(gained))
            kept |= gained
        elif len(kept) > share:
            extra = sorted(kept)[share:]
            released = self.store.release_lanes(extra)
            log.info("gave back lanes %s (fair share %d)", sorted(released), share)
            kept -= released
        self.owned = kept
        return kept

    def release_all(self) -> None:
        """Give every lane back (on a clean stop)."""
        released = self.store.release_lanes(None)
        if released:
            log.info("gave back lanes %s", sorted(released))
        self.owned = set()

"""How the ``outbox`` command shows things: readable tables, and stable JSON.

The JSON shapes are part of the interface (docs/operations.md lists them):
keys are only ever added, never renamed or removed. Times are ISO 8601 with
their offset, ids are strings, keys are text (``0x``-prefixed hex when they
are not UTF-8), and durations are seconds.

Whatever the tables show that came from the outbox tables (topics, keys,
header names, errors, reasons, who decided) passes through ``printable``
first: a message's key is chosen by whoever enqueues, and a key holding
an escape sequence must not clear or rewrite the operator's terminal. JSON
needs no such care: ``json.dumps`` escapes every control character (and
everything beyond ASCII) itself.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from outbox.inspection import Listing, Timeline
from outbox.retention import PurgeReport
from outbox.states import State
from outbox.status import HeldKey, StatusLine

#: What ``printable`` escapes, and how: the backslash (so that an escape is never ambiguous),
#: C0 controls (newline, tab, ESC, BEL, ...), DEL, C1 controls (which some terminals read as
#: CSI and other introducers), line and paragraph separators, and the bidirectional
#: formatting characters that reorder what the eye reads.
_ESCAPES: dict[int, str] = {
    ord("\\"): "\\\\",
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
    **{c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (9, 10, 13)},
    **{
        c: f"\\u{c:04x}"
        for c in (
            0x061C,
            0x200E,
            0x200F,
            0x2028,
            0x2029,
            *range(0x202A, 0x202F),
            *range(0x2066, 0x206A),
        )
    },
}


def printable(text: object) -> str:
    """``text`` (``str()`` of it) safe to print on a terminal: control characters escaped.

    Newline, carriage return and tab become ``\\n``, ``\\r``, ``\\t``; other
    C0 controls, DEL and C1 controls ``\\xNN``; line and paragraph separators
    and bidirectional formatting characters ``\\uNNNN``; a backslash doubles.
    Everything else, letters of any script included, is left as it is. ``None``
    shows as ``-``.
    """
    if text is None:
        return "-"
    return str(text).translate(_ESCAPES)


def key_text(key: bytes | None) -> str | None:
    """A Kafka key as text: itself when it is UTF-8, else ``0x`` and its hex."""
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return "0x" + key.hex()


def _plain(value: Any) -> Any:
    """Make a value JSON-ready: times, ids and bytes as text, containers recursively."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes | memoryview):
        return key_text(bytes(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """Pretty, stable JSON of plain values, datetimes, UUIDs and bytes."""
    return json.dumps(_plain(value), indent=2)


def age(seconds: float | None) -> str:
    """A duration for people: ``42s``, ``3m 20s``, ``5h 02m``, ``2d 03h``."""
    if seconds is None:
        return "-"
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def table(rows: Sequence[Sequence[str]], *, right: frozenset[int] = frozenset()) -> str:
    """Columns padded to their widest cell; the last column is never padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row[:-1])
        ]
        out.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(out)


def _time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# --- status ------------------------------------------------------------------


def _line_json(line: StatusLine) -> dict[str, Any]:
    d = asdict(line)
    del d["live_publishers"]
    return d


def _summary(lines: list[StatusLine], topic: str | None) -> list[StatusLine]:
    """The lines a status report is summed up from: over all topics, or one topic's."""
    return [line for line in lines if line.topic == topic]


def status_json(lines: list[StatusLine], held: list[HeldKey], *, topic: str | None = None) -> str:
    """``outbox status --json`` (``topic``: only that topic's lines and held keys)."""
    summary = _summary(lines, topic)
    topics: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        if line.topic is not None and topic in (None, line.topic):
            topics.setdefault(line.topic, []).append(_line_json(line))
    shown = [line for line in lines if topic in (None, line.topic)]
    return to_json(
        {
            "healthy": all(line.healthy for line in shown),
            # Every line carries it; the all-topics lines always exist.
            "live_publishers": lines[0].live_publishers if lines else 0,
            "topic": topic,
            # Every state, as over all topics: a topic's lines are only its states with messages.
            "counts": {state.value: 0 for state in State}
            | {line.state: line.messages for line in summary},
            "states": [_line_json(line) for line in summary],
            "topics": topics,
            "held_keys": [asdict(h) for h in held if topic in (None, h.topic)],
        }
    )


def _status_rows(lines: list[StatusLine], *, with_topic: bool) -> list[list[str]]:
    head = ["STATE", "MESSAGES", "OLDEST", "RETRYING", "HELD KEYS", "NEXT ACTION"]
    rows = [["TOPIC", *head] if with_topic else head]
    for line in lines:
        cells = [
            printable(line.state),
            ("" if line.exact else "~") + str(line.messages),
            age(line.oldest_age_seconds),
            str(line.retrying),
            str(line.held_keys),
            ("NEEDS ACTION: " if not line.healthy else "") + printable(line.next_action),
        ]
        rows.append([printable(line.topic or ""), *cells] if with_topic else cells)
    return rows


def status_text(lines: list[StatusLine], held: list[HeldKey], *, topic: str | None = None) -> str:
    """``outbox status``: states over all topics (or one), then per topic, leases, held keys."""
    summary = _summary(lines, topic)
    per_topic = [line for line in lines if line.topic is not None and topic is None]
    held = [h for h in held if topic in (None, h.topic)]
    live = lines[0].live_publishers if lines else 0
    healthy = all(line.healthy for line in summary + per_topic)
    out = [
        f"outbox: {'healthy' if healthy else 'ACTION NEEDED'}; {live} publisher(s) holding lanes",
        "",
        "ALL TOPICS" if topic is None else f"TOPIC {printable(topic)} (states with messages)",
    ]
    if summary:
        out.append(table(_status_rows(summary, with_topic=False), right=frozenset({1, 3, 4})))
    elif topic is None:
        out.append("no messages")
    elif all(line.exact for line in lines):
        out.append("no messages of this topic: check its name (outbox status lists every topic)")
    else:
        out.append(
            "no open messages of this topic, and none delivered that the estimate sees "
            "(delivered messages are estimated on a large table): check its name "
            "(outbox status lists every topic)"
        )
    if per_topic:
        out += [
            "",
            "BY TOPIC (states with messages)",
            table(_status_rows(per_topic, with_topic=True), right=frozenset({2, 4, 5})),
        ]
    if not all(line.exact for line in summary + per_topic):
        out += [
            "",
            "~ estimated: on a large table delivered messages are not counted one by one "
            "(see docs/operations.md); every other figure is exact",
        ]
    in_flight = next((x for x in summary if x.state == "in_flight" and x.messages), None)
    if in_flight is not None:
        owners = ", ".join(printable(o) for o in in_flight.lease_owners)
        out += [
            "",
            f"IN FLIGHT: {in_flight.messages} message(s) leased by {owners}; "
            f"next lease expiry {_time(in_flight.next_lease_expiry)}; "
            f"{in_flight.leases_expired} expired",
        ]
    if held:
        out += ["", f"HELD KEYS ({len(held)}): later messages of these keys wait"]
        for h in held:
            out += [
                f"  {printable(h.topic)} / {printable(key_text(h.key))}: held by "
                f"{printable(h.held_by)} ({printable(h.state)}), {h.waiting} waiting",
                f"    why: {printable(h.reason)}",
                f"    next: {printable(h.next_action)}",
            ]
    return "\n".join(out)


# --- inspect -------------------------------------------------------------------


def timeline_json(t: Timeline) -> str:
    """``outbox inspect --json``."""
    return to_json(
        {
            "id": t.message_id,
            "state": t.state,
            "needs_action": t.needs_action,
            "next_action": t.next_action,
            "message": t.message,
            "held_behind": t.held_behind,
            "current_claim": t.claim,
            "attempts": t.attempts,
            "decisions": t.decisions,
            "timeline": [{"at": e.at, "event": e.event, **e.detail} for e in t.events],
            "notes": list(t.notes),
        }
    )


def _detail(detail: Mapping[str, Any]) -> str:
    parts = []
    for k, v in detail.items():
        if v is None or v == {}:
            continue
        if isinstance(v, datetime):
            shown = _time(v)
        elif isinstance(v, Mapping):
            shown = json.dumps(_plain(v), sort_keys=True)  # escapes by itself
        else:
            shown = printable(v)
        parts.append(f"{printable(k)}={shown}")
    return " ".join(parts)


def timeline_text(t: Timeline) -> str:
    """``outbox inspect``: the message, then its timeline, then the next action."""
    out = [f"message {t.message_id}: {printable(t.state)}"]
    m = t.message
    if m is not None:
        fields = [
            ("topic", printable(m["topic"])),
            ("key", _optional(key_text(m["key"]))),
            ("value", f"{m['value_bytes']} bytes"),
            ("headers", ", ".join(printable(h) for h in m["header_names"]) or "-"),
            ("idempotency key", _optional(m["idempotency_key"])),
            ("lane / seq", f"{m['lane']} / {m['seq']}"),
            (
                "attempts",
                f"{m['attempts']} ({m['failures']} failed, counted toward --max-attempts, "
                "since the last decision)",
            ),
            ("fence", m["fence"]),
            ("location", _location(m)),
            ("available at", _time(m["available_at"])),
            ("lease", f"{printable(m['lease_owner'])} until {_time(m['lease_expires_at'])}"),
            ("escalated at", _time(m["escalated_at"]) if m["escalated_at"] else None),
            ("last error", _optional(m["last_error"])),
        ]
        out += [f"  {name + ':':<17}{value}" for name, value in fields if _shown(name, value, m)]
    else:
        out.append("  (the message row was purged by retention; its evidence is below)")
    out += ["", "TIMELINE"]
    out += [
        f"  {_time(e.at)}  {printable(e.event)}  {_detail(e.detail)}".rstrip() for e in t.events
    ]
    out += [f"  (note: {printable(note)})" for note in t.notes]
    out += ["", f"next: {printable(t.next_action)}"]
    return "\n".join(out)


def _location(m: Mapping[str, Any]) -> str:
    """Where the message's record is, as far as its row says (an uncertain message knows
    its partition, not yet its offset; an operator may mark one delivered without them)."""
    partition, offset = m["kafka_partition"], m["kafka_offset"]
    if partition is None:
        return "not recorded"
    return f"partition {partition} offset {'not known' if offset is None else offset}"


def _optional(value: object) -> str | None:
    """``printable`` of a field the timeline leaves out when it is ``None``."""
    return None if value is None else printable(value)


#: States whose row's partition says where its record is (or may be): delivered, uncertain
#: ("offset not known": written there or nowhere), and discarded (decided from either).
#: Quarantined and pending rows keep the partition a send aimed at, which wrote nothing.
_LOCATED = frozenset({"delivered", "uncertain", "discarded"})


def _shown(name: str, value: Any, m: Mapping[str, Any]) -> bool:
    if name == "location":
        return m["kafka_partition"] is not None and m["state"] in _LOCATED
    if name == "lease":
        return m["lease_owner"] is not None and bool(m["state"] == "in_flight")
    if name == "available at":
        return bool(m["state"] == "pending")
    return value is not None


# --- list --------------------------------------------------------------------


def listing_json(listing: Listing) -> str:
    """``outbox list --json``."""
    return to_json({"messages": listing.messages, "more": listing.more})


def listing_text(listing: Listing, *, now: datetime) -> str:
    """``outbox list``: one line per message, oldest first."""
    if not listing.messages:
        return "no messages"
    # The fence is what a decision on the message names (resolve/retry/discard --fence).
    rows = [["ID", "TOPIC", "KEY", "AGE", "ATTEMPTS", "FENCE", "DETAIL"]]
    for m in listing.messages:
        rows.append(
            [
                str(m["id"]),
                printable(m["topic"]),
                printable(key_text(m["key"])) or "-",
                age((now - m["created_at"]).total_seconds()),
                str(m["attempts"]),
                str(m["fence"]),
                _list_detail(m),
            ]
        )
    text = table(rows, right=frozenset({3, 4, 5}))
    if listing.more:
        text += f"\n(more than {len(listing.messages)}; raise --limit to see them)"
    return text


def _list_detail(m: Mapping[str, Any]) -> str:
    state = m["state"]
    error = printable(m["last_error"] or "")
    if state == "in_flight":
        return f"leased by {printable(m['lease_owner'])} until {_time(m['lease_expires_at'])}"
    if state == "delivered":
        return _location(m)
    if state == "pending" and m["failures"]:
        return f"retry at {_time(m['available_at'])}: {error}"
    if state == "uncertain" and m["escalated_at"] is not None:
        return f"ESCALATED: {error}"
    return error


# --- purge -------------------------------------------------------------------


def purge_text(report: PurgeReport, *, dry_run: bool) -> str:
    """``outbox purge``."""
    verb = "would delete" if dry_run else "deleted"
    steps = "" if dry_run else f" in {report.steps} transactions"
    return (
        f"{verb} {report.messages} delivered message(s); evidence of purged messages: "
        f"{report.attempts} attempt(s), {report.decisions} decision(s), "
        f"{report.batches} batch(es){steps}"
    )


def purge_json(report: PurgeReport, *, dry_run: bool) -> str:
    """``outbox purge --json``."""
    return to_json({"dry_run": dry_run, **asdict(report)})

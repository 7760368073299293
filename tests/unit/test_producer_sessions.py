"""Each producer a sink opens is a session of its own, with an id no fence has hit."""

from __future__ import annotations

from publisher.sink import ProducerSessions


def test_each_session_gets_the_next_number_of_its_prefix() -> None:
    """Numbered from 1, never reused: a fenced session's id is never taken up again."""
    sessions = ProducerSessions("outbox-p1")
    assert [sessions.next_id() for _ in range(3)] == ["outbox-p1-1", "outbox-p1-2", "outbox-p1-3"]


def test_without_a_prefix_there_is_no_transactional_id() -> None:
    """Idempotent delivery: no session id, however many producers are opened."""
    sessions = ProducerSessions(None)
    assert [sessions.next_id(), sessions.next_id()] == [None, None]

"""A batch's send window: the hand-over limit and the write deadline, on both clocks."""

from __future__ import annotations

import time

from publisher.sink import SendWindow, window_open


def test_the_write_deadline_passes_on_the_wall_clock_alone() -> None:
    """A wall clock past the deadline closes the window even where the monotonic one has not.

    The monotonic clock stops while a machine is suspended; the wall clock
    counts that time, so a process woken from it must not write.
    """
    mono, wall = time.monotonic(), time.time()
    window = SendWindow(mono + 60, mono + 60, wall - 1)
    assert not window.may_write()
    assert window.may_hand_over()


def test_the_write_deadline_passes_on_the_monotonic_clock_alone() -> None:
    """A monotonic clock past the deadline closes it even where the wall clock was set back."""
    mono, wall = time.monotonic(), time.time()
    window = SendWindow(mono + 60, mono - 1, wall + 60)
    assert not window.may_write()


def test_a_window_counts_both_limits_from_now() -> None:
    """``from_now`` opens both limits for their own lengths; no window means no limit."""
    window = SendWindow.from_now(hand_over_seconds=-1.0, write_deadline_seconds=60.0)
    assert not window.may_hand_over()
    assert not window_open(window)
    assert window.may_write()
    assert window_open(None)

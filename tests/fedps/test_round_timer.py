"""The phase timer (fedps/round_timer.py): phases nest and count exclusively, on a clock the
test moves by hand (no wall-clock time is measured)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fedps.round_timer import BEFORE_BARRIER, CLIENT_PHASES, CRITICAL_PATH, RoundTimer


class _Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_nested_phase_counts_for_itself_not_for_the_phase_around_it() -> None:
    # Prepare
    clock = _Clock()
    timer = RoundTimer(clock)
    # Execute: 5 s of training, 2 of them drawing noise, then 1 s of pushing
    with timer.phase("train"):
        clock.now += 1.0
        with timer.phase("noise"):
            clock.now += 2.0
        clock.now += 2.0
    with timer.phase("push"):
        clock.now += 1.0
    # Assert
    assert timer.seconds() == {"train": 3.0, "noise": 2.0, "push": 1.0}
    assert sum(timer.seconds().values()) == 6.0  # no more than the time that passed


def test_a_phase_entered_again_adds_up_and_take_starts_a_new_round() -> None:
    # Prepare
    clock = _Clock()
    timer = RoundTimer(clock)
    # Execute
    for _ in range(3):
        with timer.phase("noise"):
            clock.now += 0.5
    timer.add("fetch", 0.25)
    taken = timer.take()
    # Assert
    assert taken == {"noise": 1.5, "fetch": 0.25}
    assert timer.seconds() == {}


def test_a_phase_that_raises_is_timed() -> None:
    # Prepare
    clock = _Clock()
    timer = RoundTimer(clock)
    # Execute
    with pytest.raises(RuntimeError), timer.phase("pull"):
        clock.now += 4.0
        raise RuntimeError("shard down")
    # Assert
    assert timer.seconds() == {"pull": 4.0}


def test_waiting_for_a_stream_counts_apart_from_the_work_on_what_it_yields() -> None:
    # Prepare: each message takes 1 s to arrive, and 3 s to check
    clock = _Clock()
    timer = RoundTimer(clock)

    def slow(items: list[int]) -> Iterator[int]:
        for item in items:
            clock.now += 1.0
            yield item

    # Execute
    with timer.phase("verify"):
        for _ in timer.iterate("fetch", slow([1, 2])):
            clock.now += 3.0
    # Assert
    assert timer.seconds() == {"fetch": 2.0, "verify": 6.0}


def test_a_negative_measurement_counts_nothing() -> None:
    timer = RoundTimer()

    timer.add("commit", -1.0)

    assert timer.seconds() == {"commit": 0.0}


def test_the_phase_names_are_in_round_order() -> None:
    assert CLIENT_PHASES.index("train") < CLIENT_PHASES.index("commit")
    assert "barrier" not in BEFORE_BARRIER and "commit" in BEFORE_BARRIER
    assert CRITICAL_PATH[0] == "open" and CRITICAL_PATH[-1] == "other"
    assert len(set(CRITICAL_PATH)) == len(CRITICAL_PATH)

"""Missed call deadlines, counted per shard (server/shard_misses.py): the runs in a row, the
totals, and the shard named once its run reaches the limit.

The calls here are plain functions on a clock the test moves: a call that "runs out its
deadline" advances the clock by the deadline and raises what the transport raises then
(:class:`~fedps.errors.PeerUnavailableError`). The real deadlines of real servers are in
tests/security/test_stalling_shard.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fedps.errors import PeerUnavailableError, RoundClosedError, ShardStalledError
from server.shard_misses import ShardMisses

DEADLINE_S = 10.0


class _Clock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


def _misses(clock: _Clock, limit: int = 3) -> tuple[ShardMisses, list[tuple[str, str]]]:
    """A counter on ``clock`` and the (shard, call) of every miss it reported."""
    seen: list[tuple[str, str]] = []
    misses = ShardMisses(limit=limit, deadline_s=DEADLINE_S, clock=clock)
    misses.on_miss = lambda shard, call: seen.append((shard, call))
    return misses, seen


def _stall(clock: _Clock, seconds: float = DEADLINE_S) -> None:
    """A call the shard held open until the caller gave up after ``seconds``."""
    clock.now += seconds
    raise PeerUnavailableError("close round on shard-1: Deadline Exceeded")


def _answer() -> str:
    return "closed"


def test_misses_in_a_row_name_the_shard_at_the_limit(clock: _Clock) -> None:
    # Prepare
    misses, seen = _misses(clock, limit=3)

    # Execute: the first two misses are the transport's error again (the caller retries)
    for _ in range(2):
        with pytest.raises(PeerUnavailableError):
            misses.call("shard-1", "CloseRound", lambda: _stall(clock))
    runs_before = misses.in_a_row()
    # ... the third names the shard
    with pytest.raises(ShardStalledError) as stalled:
        misses.call("shard-1", "CloseRound", lambda: _stall(clock))

    # Assert
    assert runs_before == {"shard-1": 2}
    message = str(stalled.value)
    assert message.startswith("shard-1 missed its 10 s deadline 3 times in a row (CloseRound)")
    assert "restart it or replace it (docs/operations.md)" in message
    assert misses.totals() == {"shard-1": 3} and misses.in_a_row() == {"shard-1": 3}
    assert misses.stalled == ["shard-1"]
    assert seen == [("shard-1", "CloseRound")] * 3


def test_an_answer_resets_the_run_and_the_total_stays(clock: _Clock) -> None:
    # Prepare: two misses
    misses, _ = _misses(clock, limit=3)
    for _ in range(2):
        with pytest.raises(PeerUnavailableError):
            misses.call("shard-1", "OpenRound", lambda: _stall(clock))

    # Execute: an answer, then two more misses; an error answer, then two more
    answered = misses.call("shard-1", "OpenRound", _answer)
    after_answer = (misses.in_a_row(), misses.stalled)
    for _ in range(2):
        with pytest.raises(PeerUnavailableError):
            misses.call("shard-1", "OpenRound", lambda: _stall(clock))

    def refuse() -> None:
        raise RoundClosedError("open round on shard-1: round 3 is unknown")

    with pytest.raises(RoundClosedError):  # the shard answered, with an error: it is alive
        misses.call("shard-1", "OpenRound", refuse)
    with pytest.raises(PeerUnavailableError):
        misses.call("shard-1", "OpenRound", lambda: _stall(clock))

    # Assert: never three in a row, so never named; every miss is in the total
    assert answered == "closed"
    assert after_answer == ({}, [])
    assert misses.in_a_row() == {"shard-1": 1}
    assert misses.totals() == {"shard-1": 5}
    assert misses.stalled == []


def test_each_shard_has_its_own_run(clock: _Clock) -> None:
    # Prepare
    misses, _ = _misses(clock, limit=2)

    # Execute: shard-1 misses, shard-0 answers in between, shard-1 misses again
    with pytest.raises(PeerUnavailableError):
        misses.call("shard-1", "FetchAggregate", lambda: _stall(clock))
    misses.call("shard-0", "FetchAggregate", _answer)
    with pytest.raises(ShardStalledError, match=r"^shard-1 missed"):
        misses.call("shard-1", "FetchAggregate", lambda: _stall(clock))

    # Assert: the honest shard is never counted
    assert misses.totals() == {"shard-1": 2}
    assert misses.stalled == ["shard-1"]


def test_a_shard_that_fails_fast_misses_once_per_deadline_of_silence(clock: _Clock) -> None:
    # Prepare: a shard that is down (restarting): each call fails after 1 s, not its deadline
    misses, seen = _misses(clock, limit=3)

    # Execute: 25 calls, one after the other, 25 s of silence
    for _ in range(25):
        with pytest.raises(PeerUnavailableError):
            misses.call("shard-1", "OpenRound", lambda: _stall(clock, seconds=1.0))

    # Assert: one miss for each whole deadline it did not answer; a restart that takes less
    # than a deadline costs no miss at all
    assert misses.totals() == {"shard-1": 2}
    assert len(seen) == 2


def test_a_streamed_reply_must_end_within_the_deadline(clock: _Clock) -> None:
    # Prepare: a reply that streams one part, then is cut off at the deadline; a whole one
    misses, _ = _misses(clock, limit=3)

    def cut_off() -> Iterator[str]:
        yield "part"
        _stall(clock)

    def whole() -> Iterator[str]:
        yield from ("part", "part")

    # Execute
    parts: list[str] = []
    with pytest.raises(PeerUnavailableError):
        parts.extend(misses.stream("shard-1", "FetchAggregate", cut_off()))
    run_after_cut = misses.in_a_row()
    parts.extend(misses.stream("shard-1", "FetchAggregate", whole()))
    run_after_whole = misses.in_a_row()
    with pytest.raises(PeerUnavailableError):
        list(misses.stream("shard-1", "FetchAggregate", cut_off()))
    # ... a reader that stops early (a block it refused) neither answers nor misses
    left = misses.stream("shard-1", "FetchAggregate", whole())
    next(left)
    left.close()

    # Assert
    assert parts == ["part", "part", "part"]
    assert run_after_cut == {"shard-1": 1} and run_after_whole == {}
    assert misses.in_a_row() == {"shard-1": 1}
    assert misses.totals() == {"shard-1": 2}


@pytest.mark.parametrize(("limit", "deadline_s"), [(0, 1.0), (1, 0.0)])
def test_a_limit_below_one_or_no_deadline_is_refused(limit: int, deadline_s: float) -> None:
    # Execute / Assert
    with pytest.raises(ValueError):
        ShardMisses(limit=limit, deadline_s=deadline_s)

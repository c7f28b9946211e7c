"""Tests for fedps.rpc.fan_out: one call per peer, all at once, every call to its end."""

from __future__ import annotations

import threading

import pytest

from fedps.errors import PeerUnavailableError
from fedps.rpc.fan_out import fan_out
from tests.waiting import HANG_S


def test_the_calls_run_at_once_and_their_results_come_back_by_key() -> None:
    # Prepare: each call waits for the other (run one after the other, the first never returns)
    meeting = threading.Barrier(2, timeout=HANG_S)

    def meet(value: int) -> int:
        meeting.wait()
        return value

    # Execute
    results = fan_out({"shard-1": lambda: meet(1), "shard-0": lambda: meet(0)})
    # Assert
    assert list(results.items()) == [("shard-1", 1), ("shard-0", 0)]


def test_a_failed_call_is_raised_once_every_call_ended() -> None:
    # Prepare
    ended: list[str] = []
    meeting = threading.Barrier(2, timeout=HANG_S)

    def fail() -> str:
        meeting.wait()
        raise PeerUnavailableError("shard-0 is down")

    def succeed() -> str:
        meeting.wait()
        ended.append("shard-1")
        return "ok"

    # Execute / Assert
    with pytest.raises(PeerUnavailableError, match="shard-0 is down"):
        fan_out({"shard-0": fail, "shard-1": succeed})
    assert ended == ["shard-1"]


def test_one_call_runs_in_the_callers_thread() -> None:
    # Execute
    results = fan_out({"shard-0": threading.current_thread})
    # Assert
    assert results == {"shard-0": threading.current_thread()}
    assert fan_out({}) == {}

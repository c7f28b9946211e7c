"""A role's start (fedps/startup.py): loaded with the garbage collector paused, then frozen."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from fedps.startup import loading


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    """This process's collector as it was: running, nothing frozen by the test."""
    yield
    gc.unfreeze()
    gc.enable()


def test_the_collector_is_paused_in_the_block_and_what_it_made_is_frozen_after() -> None:
    # Prepare
    gc.unfreeze()
    # Execute
    with loading():
        paused = not gc.isenabled()
        # long-lived objects, as a role's set-up makes them
        made: list[list[int]] = [[] for _ in range(1000)]
    # Assert
    assert paused and gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    assert all(o is not made for o in gc.get_objects())  # left out of every collection


def test_a_paused_collector_stays_paused_and_an_error_still_freezes() -> None:
    # Prepare
    gc.unfreeze()
    gc.disable()
    # Execute
    with pytest.raises(RuntimeError), loading():
        raise RuntimeError("a role that fails to start")
    # Assert
    assert not gc.isenabled() and gc.get_freeze_count() > 0

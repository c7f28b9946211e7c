"""Waiting for an event with a hang guard, never a time budget.

A test waits for the condition it needs however long a loaded machine takes; the guard is
far above the normal time and only stops a run where something is really stuck, with a
message that says what never happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["HANG_S", "wait_for"]

#: The default hang guard: more than ten times what any wait in the suite normally takes.
HANG_S = 600.0


def wait_for(
    condition: Callable[[], bool], what: str, *, hang_s: float = HANG_S, poll_s: float = 0.05
) -> None:
    """Poll ``condition`` until it holds.

    Raises
    ------
    AssertionError
        ``condition`` still false after ``hang_s`` seconds: something is stuck.
    """
    until = time.monotonic() + hang_s
    while not condition():
        if time.monotonic() > until:
            raise AssertionError(f"hang guard: {what} did not happen in {hang_s:g} s")
        time.sleep(poll_s)

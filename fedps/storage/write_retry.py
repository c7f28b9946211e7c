"""A write retried with a growing delay until it succeeds or the caller stops.

For state a role must not go on without (a checkpoint, a privacy-ledger record): a full disk
holds the role, logged, until space is freed, instead of losing what it would have written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["write_until_written"]

_log = logging.getLogger("fedps")

#: The first delay between attempts, and the longest (each failure doubles it).
_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 30.0


def write_until_written(
    write: Callable[[], None],
    *,
    retry_on: type[Exception] | tuple[type[Exception], ...],
    failure: Callable[[Exception], str],
    stop: threading.Event,
) -> bool:
    """Call ``write`` until it returns; False if ``stop`` was set first.

    Parameters
    ----------
    write
        The write; it raises one of ``retry_on`` when nothing was written.
    retry_on
        The errors that mean "try again" (any other propagates).
    failure
        The ERROR line for a failed attempt, without the retry delay.
    stop
        Set when the caller stops: the retries end.

    Returns
    -------
    bool
        True once written.
    """
    delay = _FIRST_DELAY_S
    while True:
        try:
            write()
            return True
        except retry_on as exc:
            _log.error("%s; retrying in %.1f s", failure(exc), delay)
            if stop.wait(delay):
                return False
            delay = min(2 * delay, _MAX_DELAY_S)

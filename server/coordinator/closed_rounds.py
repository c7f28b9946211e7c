"""The contributor sets of the last rounds the coordinator sent to the key holder to apply.

A key-holder party (``keyholder.parties`` above 1) asks for the set a round closed with and
decrypts nothing else (:mod:`server.keyholder.keyholder_party`).
"""

from __future__ import annotations

import threading

from fedps.errors import InvalidArgumentError

__all__ = ["ClosedRounds"]


class ClosedRounds:
    """The set each of the last ``kept`` rounds closed with, by round (thread-safe).

    Parameters
    ----------
    kept
        How many of the latest rounds are kept for the parties' retries.
    """

    def __init__(self, kept: int = 8) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._closed: dict[int, frozenset[str]] = {}

    def add(self, round_: int, contributors: frozenset[str]) -> None:
        """Round ``round_`` is sent to the key holder with ``contributors``."""
        with self._lock:
            self._closed[round_] = contributors
            for old in sorted(self._closed)[: -self._kept]:
                del self._closed[old]

    def get(self, round_: int) -> frozenset[str]:
        """The clients ``round_`` closed with, once it was sent to the key holder to apply.

        Raises
        ------
        InvalidArgumentError
            ``round_`` was not sent to the key holder (or not among the last rounds).
        """
        with self._lock:
            closed = self._closed.get(round_)
        if closed is None:
            raise InvalidArgumentError(f"round {round_} is not a round being applied")
        return closed

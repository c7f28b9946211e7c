"""Tests for the write retried until it is written."""

from __future__ import annotations

import logging
import threading

import pytest

from fedps.storage.write_retry import write_until_written


def test_a_write_that_fails_is_retried_until_it_is_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: a write that fails twice (a full disk), then succeeds
    attempts: list[int] = []

    def write() -> None:
        attempts.append(len(attempts))
        if len(attempts) <= 2:
            raise OSError(28, "No space left on device")

    # Execute
    with caplog.at_level(logging.ERROR, logger="fedps"):
        written = write_until_written(
            write,
            retry_on=OSError,
            failure=lambda exc: f"cannot write ({exc})",
            stop=threading.Event(),
        )

    # Assert: three attempts, each failure one line with its growing delay
    assert written and len(attempts) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "cannot write ([Errno 28] No space left on device); retrying in 0.5 s",
        "cannot write ([Errno 28] No space left on device); retrying in 1.0 s",
    ]


def test_a_stop_ends_the_retries_and_another_error_is_raised() -> None:
    # Prepare
    stop = threading.Event()
    stop.set()

    def full() -> None:
        raise OSError(28, "No space left on device")

    def broken() -> None:
        raise ValueError("not a write failure")

    # Execute / Assert
    assert not write_until_written(full, retry_on=OSError, failure=str, stop=stop)
    with pytest.raises(ValueError, match="not a write failure"):
        write_until_written(broken, retry_on=OSError, failure=str, stop=stop)

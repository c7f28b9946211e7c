"""Tests for clients.error_feedback: the residual of sparsified updates and its state file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.error_feedback import RESIDUAL_FILE, ErrorFeedback
from fedps.errors import CorruptStateError


def test_the_residual_is_what_was_not_sent_and_survives_a_restart(tmp_path: Path) -> None:
    # Prepare
    feedback = ErrorFeedback(5, tmp_path)
    update = np.array([1.0, 2.0, 3.0, 4.0, 5.0])

    # Execute: send coordinates 0 and 3, then add the residual to the next update
    total = feedback.add(update)
    feedback.keep(total, np.array([0, 3]))
    restarted = ErrorFeedback(5, tmp_path)

    # Assert
    np.testing.assert_array_equal(total, update)  # nothing kept before
    np.testing.assert_array_equal(feedback.residual, [0.0, 2.0, 3.0, 0.0, 5.0])
    np.testing.assert_array_equal(restarted.residual, feedback.residual)
    np.testing.assert_array_equal(restarted.add(np.ones(5)), [1.0, 3.0, 4.0, 1.0, 6.0])


def test_a_residual_of_another_model_is_dropped_and_a_corrupt_one_stops(tmp_path: Path) -> None:
    # Prepare
    ErrorFeedback(5, tmp_path).keep(np.ones(5), np.array([0]))

    # Execute / Assert: another size starts from zero; a damaged file is reported
    assert not ErrorFeedback(7, tmp_path).residual.any()
    path = tmp_path / RESIDUAL_FILE
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    with pytest.raises(CorruptStateError, match="residual"):
        ErrorFeedback(5, tmp_path)


def test_in_memory_feedback_writes_nothing(tmp_path: Path) -> None:
    # Execute
    feedback = ErrorFeedback(3)
    feedback.keep(np.ones(3), np.array([1]))

    # Assert
    assert feedback.path is None
    np.testing.assert_array_equal(feedback.residual, [1.0, 0.0, 1.0])

"""``task.client_eval`` (clients/client_eval.py): the round's starting model evaluated on the
client's own data, reported once with its round."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from clients.client_eval import ClientEvaluation
from clients.client_setup import client_partition
from fedps.config import load_config
from fedps.learning.tasks import load_task
from fedps.sharding.blocks import flatten_model


def test_a_rounds_metrics_are_kept_until_its_report_and_given_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: the configured task (digits, an MLP) and client 0's data
    config = load_config(None, task={"client_eval": True})
    task = load_task(config)
    data = client_partition(config, 0, task=task)
    vector = flatten_model(task.create_model(config.training.seed))

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedps"):
        evaluation = ClientEvaluation(task, data, seed=config.training.seed, name="edge-0")
    first = evaluation.evaluate(1, vector)
    second = evaluation.evaluate(2, np.zeros_like(vector))

    # Assert: the loss and the task's metrics; a later round's replace an earlier one's,
    # which its report no longer gets; each is given once; the client said where they go
    assert {"loss", "accuracy"} <= set(first) and first != second
    assert evaluation.take(1) == {}
    assert evaluation.take(2) == second
    assert evaluation.take(2) == {}
    assert "outside the DP guarantee" in caplog.text

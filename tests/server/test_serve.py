"""Role wiring (server/serve.py): what a role says about its metrics endpoint when it starts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import start_cluster


def test_public_metrics_warn_when_a_role_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a shard whose metrics listen on every interface, opted in explicitly
    metrics = {"shards": ["0.0.0.0:0"], "public": True}

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedps"):
        cluster = start_cluster(tmp_path, num_shards=1, coordinator=False, metrics=metrics)
    cluster.stop()

    # Assert
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("shard-0 metrics on 0.0.0.0:0 are public" in w for w in warnings), warnings


def test_loopback_metrics_start_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = {"keyholder": "127.0.0.1:0"}

    with caplog.at_level(logging.WARNING, logger="fedps"):
        cluster = start_cluster(tmp_path, num_shards=1, coordinator=False, metrics=metrics)
    cluster.stop()

    assert not [r for r in caplog.records if "metrics" in r.getMessage()]
